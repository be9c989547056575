"""The trainer's clients of peers (swarm/trainer/clients.py): bounded by use, with real channels to a
real stage server on loopback and a clock the test moves."""

from __future__ import annotations

import pytest
import torch

from peer.service import start_server
from peer.worker import StageWorker
from swarm.client import StageClient
from swarm.config import load_config
from swarm.trainer.clients import IdleClients
from tests.conftest import CONFIGS

IDLE_S = 10.0


@pytest.fixture(scope="module")
def address():
    """HOST:PORT of a real stage-0 server (plaintext) for the module's tests."""
    run = load_config(CONFIGS / "tiny.toml")
    worker = StageWorker(run, 0, torch.device("cpu"))
    server, _, port = start_server(worker, "127.0.0.1", 0)
    yield f"127.0.0.1:{port}"
    server.stop(0)
    worker.close()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def clients_of(address: str, clock: Clock) -> tuple[IdleClients, list[StageClient]]:
    """A cache whose clients all call `address` (the key stands for a peer); and the list of those closed."""
    run = load_config(CONFIGS / "tiny.toml")
    closed: list[StageClient] = []

    def close(client: StageClient) -> None:
        closed.append(client)
        client.close()

    return IdleClients(lambda key: StageClient(address, run), close, IDLE_S, clock), closed


def is_closed(client: StageClient) -> bool:
    try:
        client.info(timeout=10)
    except ValueError as err:  # grpc-python: "Cannot invoke RPC on closed channel!"
        assert "closed channel" in str(err)
        return True
    return False


def test_a_client_unused_for_idle_s_is_closed_and_made_anew_when_called_again(address):
    clock = Clock()
    clients, closed = clients_of(address, clock)
    a, b = clients.get("a"), clients.get("b")
    assert clients.get("a") is a  # kept while in use
    clock.now = 6.0
    assert clients.get("a") is a
    clock.now = 12.0  # b unused for 12 s, a for 6 s
    c = clients.get("c")
    assert closed == [b] and is_closed(b)
    assert not is_closed(a) and not is_closed(c)
    assert set(clients.values()) == {a, c}
    again = clients.get("b")
    assert again is not b and not is_closed(again)


def test_peers_called_one_after_another_never_hold_more_clients_than_were_used_within_idle_s(address):
    clock = Clock()
    clients, closed = clients_of(address, clock)
    for i in range(100):  # a new peer every second, as churn brings them
        clock.now = float(i)
        clients.get(f"peer{i}")
        assert len(clients) <= IDLE_S + 1
    assert len(closed) == 100 - len(clients) and all(is_closed(c) for c in closed[:3])


def test_clear_closes_every_client(address):
    clients, closed = clients_of(address, Clock())
    made = [clients.get(k) for k in "abc"]
    clients.clear()
    assert closed == made and len(clients) == 0 and all(is_closed(c) for c in made)
