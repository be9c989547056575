"""Readiness by contract: a process started with `--ready-file PATH` writes there, once it serves,
a small JSON file saying where (`swarm peer`: `PeerReady`, `swarm coordinator`: `CoordinatorReady`).

Whoever started it waits for the file (`wait_ready`) instead of reading its printed output, so
rewording a message breaks nobody. The file is written whole or not at all (a temporary file in
the same folder, renamed over it): a reader never sees half of it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from swarm.children import Proc

POLL_S = 0.05


class PeerReady(BaseModel):
    """A stage worker that serves: trainers can call it at `address`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    stage: int = Field(ge=0)
    address: str = Field(description="HOST:PORT of its gRPC server, as callers should dial it")
    peer_id: str | None = Field(default=None, description="its DHT peer id; None for a stage served by hand")
    public_name: str | None = Field(default=None, description="its name on the dashboard; None by hand")


class CoordinatorReady(BaseModel):
    """A coordinator that serves its REST API at `url`, with its DHT node up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    url: str = Field(description="base URL of the REST API and the dashboard, e.g. http://127.0.0.1:8000")
    http_port: int = Field(ge=1, le=65535)
    dht_maddrs: list[str] = Field(description="the DHT node's multiaddrs, as /api/v1/join hands them out")


Ready = TypeVar("Ready", PeerReady, CoordinatorReady)


def write_ready(path: Path, ready: BaseModel) -> None:
    """Write `ready` to `path` as JSON, atomically."""
    write_whole(Path(path), (ready.model_dump_json() + "\n").encode())


def write_whole(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (temporary file + rename): a reader sees all of it or none."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_ready(path: Path, kind: type[Ready]) -> Ready | None:
    """The ready file's contents, or None while there is none."""
    try:
        return kind.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        return None


class NotReady(RuntimeError):
    """The process exited, or did not write its ready file in time; the message ends with its log's tail."""


def wait_ready(proc: Proc, kind: type[Ready], timeout: float) -> Ready:
    """The contents of `proc`'s ready file (`proc.ready_file`) once it is there; NotReady when the
    process exits or `timeout` passes first."""
    if proc.ready_file is None:
        raise ValueError(f"wait_ready: {proc.log_path.stem} was started without a ready file")
    deadline = time.monotonic() + timeout
    while True:
        try:
            ready = read_ready(proc.ready_file, kind)
        except ValidationError as err:
            raise NotReady(f"{proc.ready_file}: not a {kind.__name__}: {err}") from None
        if ready is not None:
            return ready
        if proc.popen.poll() is not None:
            raise NotReady(f"{proc.log_path.stem} exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise NotReady(f"{proc.log_path.stem} was not ready within {timeout:.0f} s:\n{proc.output()[-3000:]}")
        time.sleep(POLL_S)
