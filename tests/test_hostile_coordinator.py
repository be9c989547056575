"""A coordinator chooses the run, not what a volunteer's or a trainer's machine reads and writes.

- A run config naming local files (`data.source = "files"`, or a Hugging Face dataset read from a
  local path) would make a trainer read them and send their bytes to stage-0 peers: a real trainer
  refuses such a config, before it joins the DHT, unless it asked for it.
- A run id like `..` would make a peer write its checkpoints outside `--checkpoint-dir`: a real peer
  refuses it, whoever serves it (here a hostile coordinator of a few lines that answers /api/v1/join
  with anything it likes)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from swarm.config import DataConfig, RunConfig, load_config
from tests.conftest import CONFIGS
from tests.processes import child, start_coordinator, survivors

TINY = CONFIGS / "tiny.toml"


def refusal(args: list[str], log: Path, timeout: float = 120) -> tuple[int | None, str]:
    """Run `swarm ARGS` (in its own process group, all of it stopped afterwards); its exit code, None
    when it was still running after `timeout` (it did not refuse), and its output."""
    proc = child(args, log)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout)
    code = proc.popen.poll()
    proc.stop()
    assert not survivors(proc.popen.pid)
    return code, proc.output()


def test_a_run_config_naming_local_files_does_not_make_the_trainer_read_them(processes, tmp_path: Path):
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot for the swarm\n" * 50)
    config = tmp_path / "run.toml"
    config.write_text(TINY.read_text().replace('source = "embedded"', f'source = "files"\npath = "{secret}"'))
    assert load_config(config).data.path == str(secret)
    coordinator, url = start_coordinator(config, tmp_path / "coordinator.log")
    try:
        # Before the defence the trainer read the file and waited for stage-0 peers to send it to.
        code, said = refusal(["train", "--coordinator", url, "--steps", "1"], tmp_path / "trainer.log")
        assert code == 2, said[-3000:]
        assert str(secret) in said and "--allow-config-files" in said, said[-3000:]
        assert "trainers refuse to read them" in coordinator.output()  # the operator is told at start
    finally:
        coordinator.stop()
    assert not survivors(coordinator.popen.pid)


@pytest.mark.parametrize(
    ("data", "local"),
    [
        ({"source": "embedded"}, []),
        ({"source": "files", "path": "/etc/passwd"}, ["/etc/passwd"]),
        ({"source": "huggingface", "dataset": "roneneldan/TinyStories"}, []),
        ({"source": "huggingface", "dataset": "/srv/corpus"}, ["/srv/corpus"]),
        ({"source": "huggingface", "dataset": "~/corpus"}, ["~/corpus"]),
        (
            {"source": "huggingface", "dataset": "text", "data_files": ["/root/.ssh/id_rsa", "hf://datasets/a/b.txt"]},
            ["/root/.ssh/id_rsa"],
        ),
        ({"source": "huggingface", "dataset": "text", "data_files": ["https://example.org/a.txt"]}, []),
    ],
)
def test_which_data_sections_name_local_files(data: dict, local: list[str]):
    assert DataConfig(**data).local_paths() == local


class HostileCoordinator(BaseHTTPRequestHandler):
    """Answers /api/v1/join with a run whose id climbs out of the peers' checkpoint folder."""

    def body(self) -> bytes:
        """The answer to a GET of self.path."""
        config = RunConfig().model_dump(exclude_none=True)
        config["run_id"] = ".."
        return json.dumps({"config": config, "initial_peers": []}).encode()

    def do_GET(self):  # noqa: N802 (the name http.server calls)
        body = self.body()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_peer_refuses_a_run_id_that_would_put_its_checkpoints_outside_its_folder(processes, tmp_path: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileCoordinator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    checkpoints = tmp_path / "home" / "checkpoints"
    checkpoints.mkdir(parents=True)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, said = refusal(["peer", "--coordinator", url, "--checkpoint-dir", str(checkpoints)], tmp_path / "p.log")
    finally:
        server.shutdown()
    assert code == 2, said[-3000:]
    assert "run_id: '..'" in said, said[-3000:]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "home", "p.log"]  # nothing else written
