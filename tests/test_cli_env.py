"""`swarm peer` and `swarm train` take what a container is told through the environment:
SWARM_COORDINATOR, SWARM_DEVICE and SWARM_PUBLIC_NAME, each only where its flag is absent."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swarm.cli import build_parser
from swarm.net import free_port

ROOT = Path(__file__).resolve().parent.parent
ENV_NAMES = ("SWARM_COORDINATOR", "SWARM_DEVICE", "SWARM_PUBLIC_NAME")


def swarm(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The real command line in a fresh interpreter, with `env` on top of an environment without SWARM_*."""
    base = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    return subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**base, **env},
    )


def unused_url() -> str:
    """A coordinator URL nobody listens on (a port the kernel just handed out and took back)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(autouse=True)
def no_swarm_environment(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def test_peer_joins_the_coordinator_named_in_the_environment_as_if_flagged(processes):
    url = unused_url()
    with ThreadPoolExecutor(2) as pool:  # each run spends seconds importing torch and hivemind
        env_run = pool.submit(swarm, "peer", "--join-wait", "0", SWARM_COORDINATOR=url)
        flag_run = pool.submit(swarm, "peer", "--join-wait", "0", "--coordinator", url)
    from_env, from_flag = env_run.result(), flag_run.result()
    assert from_env.returncode == from_flag.returncode == 2
    assert from_env.stderr == from_flag.stderr
    assert f"cannot reach {url}" in from_env.stderr and "Traceback" not in from_env.stderr


def test_an_empty_coordinator_in_the_environment_is_refused_like_the_flag(processes):
    from_env = swarm("peer", SWARM_COORDINATOR="")
    from_flag = swarm("peer", "--coordinator", "")
    assert from_env.returncode == from_flag.returncode == 2
    assert from_env.stderr == from_flag.stderr
    assert "give --coordinator URL (or $SWARM_COORDINATOR)" in from_env.stderr


def test_the_flag_wins_over_the_environment(processes):
    # An empty flag is refused at once; had the environment's URL been taken, it would be dialled.
    result = swarm("peer", "--coordinator", "", SWARM_COORDINATOR=unused_url())
    assert result.returncode == 2
    assert "give --coordinator URL" in result.stderr and "cannot reach" not in result.stderr


def test_serving_a_stage_by_hand_ignores_the_environment(processes):
    result = swarm("peer", "--config", "configs/tiny.toml", SWARM_COORDINATOR="http://127.0.0.1:1")
    assert result.returncode == 2
    assert "--config C with --stage K" in result.stderr  # not "give --coordinator or --config, not both"


def test_train_takes_the_coordinator_from_the_environment(processes):
    url = unused_url()
    result = swarm("train", "--steps", "1", "--join-wait", "0", SWARM_COORDINATOR=url)
    assert result.returncode == 2
    assert f"cannot reach {url}" in result.stderr


def test_device_and_public_name_come_from_the_environment_unless_flagged(monkeypatch):
    monkeypatch.setenv("SWARM_DEVICE", "cpu")
    monkeypatch.setenv("SWARM_PUBLIC_NAME", "attic-gpu")
    args = build_parser().parse_args(["peer"])
    assert (args.device, args.public_name) == ("cpu", "attic-gpu")
    args = build_parser().parse_args(["peer", "--device", "cuda:1", "--public-name", "other"])
    assert (args.device, args.public_name) == ("cuda:1", "other")
    monkeypatch.setenv("SWARM_DEVICE", "")  # blank: as if unset, auto
    assert build_parser().parse_args(["peer"]).device is None


def test_help_names_the_environment_variables(processes):
    peer_help = swarm("peer", "--help").stdout
    for name in ENV_NAMES:
        assert f"${name}" in peer_help, name
    assert "$SWARM_COORDINATOR" in swarm("train", "--help").stdout
