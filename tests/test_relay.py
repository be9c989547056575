"""The relay (swarm/relay.py): TCP connections carried over a peer's outbound gRPC stream.

In this process: bytes both ways, many connections at once, and the relay's refusals (an outsider,
a full relay). Against a real coordinator and peer: a stage call through the coordinator's relay is
mutual TLS from end to end, so what crosses the relay (recorded by a proxy in front of it, the
bytes a hostile relay would read) holds none of the call's plaintext.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from swarm.config import load_config
from swarm.relay import ATTACH, DECODE, ENCODE, RelayHub, RelayLink, bearer_admission, start_relay, wait_address
from swarm.rpc import pb
from tests.harness import TINY, Swarm
from tests.processes import member_client


def serve(handle) -> tuple[socket.socket, int]:
    """A TCP server on loopback calling `handle(connection)` in a thread per connection."""
    server = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def echo(conn: socket.socket) -> None:
    """Send back what arrives; hang up on b"bye"."""
    with conn:
        while (data := conn.recv(1 << 16)) and data != b"bye":
            conn.sendall(data)


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=30)


def round_trip(address: str, payload: bytes) -> bytes:
    with connect(address) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload) and (data := sock.recv(1 << 20)):
            got += data
        sender.join()
        return bytes(got)


def admit(token: str) -> None:
    if token != "member":
        raise ValueError("not a member's token")


@pytest.fixture
def relay():
    hub = RelayHub("127.0.0.1", capacity=1, admit=bearer_admission(admit))
    server, port = start_relay(hub)
    yield hub, f"127.0.0.1:{port}"
    server.stop(0)


def test_connections_to_a_relayed_port_reach_the_peer_byte_for_byte_several_at_once(relay):
    _, where = relay
    server, port = serve(echo)
    announced: list[str] = []
    link = RelayLink(lambda: [(where, None)], ("127.0.0.1", port), announced.append, join_token="member").start()
    try:
        address = wait_address(link, 10)
        assert address is not None and announced == [address] and address != where
        payloads = [os.urandom(n) for n in (1, 70_000, 3_000_000, 5_000_000)]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: round_trip(address, p), payloads)) == payloads
        with connect(address) as sock:  # the peer's end hanging up hangs up the trainer's
            sock.sendall(b"bye")
            assert sock.recv(1) == b""
    finally:
        link.stop()


def test_an_outsider_cannot_attach_and_a_full_relay_takes_nobody_more(relay):
    hub, where = relay

    def attach(token: str | None) -> grpc.RpcError | pb.RelayFrame:
        with grpc.insecure_channel(where) as channel:
            call = channel.stream_stream(ATTACH, request_serializer=ENCODE, response_deserializer=DECODE)
            metadata = [("authorization", f"Bearer {token}")] if token else None
            stream = call(iter(()), metadata=metadata)
            try:
                return next(stream)
            except grpc.RpcError as err:
                return err

    for token in (None, "guess"):
        refused = attach(token)
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "members of its run only" in refused.details()
    assert hub.attached == {}  # nothing listens for the outsider
    server, port = serve(echo)
    link = RelayLink(lambda: [(where, None)], ("127.0.0.1", port), lambda _: None, join_token="member").start()
    try:
        assert wait_address(link, 10) is not None
        full = attach("member")
        assert isinstance(full, grpc.RpcError) and full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "relay full: 1 peers attached" in full.details()
    finally:
        link.stop()
        server.close()


def test_a_stage_call_through_the_coordinators_relay_is_mutual_tls_end_to_end(processes, tmp_path: Path):
    swarm = Swarm(tmp_path)
    try:
        swarm.add_peer("p", 0)
        state = swarm.wait_online(["p"])
        record = next(p for s in state["stages"] for p in s["peers"] if p["public_name"] == "p")
        relay = httpx.get(f"{swarm.url}/api/v1/join").json()["relay"]
        host, _, port = record["address"].rpartition(":")
        link = RelayLink(lambda: [(relay, None)], (host, int(port)), lambda _: None).start()
        seen = bytearray()  # every byte both ways between the trainer and the relay

        def record_proxy(conn: socket.socket) -> None:
            upstream = connect(wait_address(link, 10))

            def copy(a: socket.socket, b: socket.socket) -> None:
                while data := a.recv(1 << 16):
                    seen.extend(data)
                    b.sendall(data)
                with contextlib.suppress(OSError):  # the other side may have closed already
                    b.shutdown(socket.SHUT_WR)

            threading.Thread(target=copy, args=(conn, upstream), daemon=True).start()
            copy(upstream, conn)

        proxy, proxy_port = serve(record_proxy)
        run = load_config(TINY)
        client = member_client(swarm.url, run, {**record, "address": f"127.0.0.1:{proxy_port}"})
        info = client.info()
        assert info.run_id == run.run_id and info.stage == 0  # the call went through
        assert len(seen) > 1000 and seen[0] == 0x16  # a TLS handshake record opens the connection
        assert run.run_id.encode() not in seen, "the run id crossed the relay in clear"
        client.close()
        proxy.close()
        link.stop()
    finally:
        swarm.close()
