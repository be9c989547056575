"""Relays: how a peer that nobody can dial (a home router without forwarded ports) still serves.

The peer dials out to a relay (the coordinator, which always is one) and keeps one gRPC stream open
(`Relay.Attach`, proto/swarm.proto). The relay listens on a port of its own for that peer and
announces it back on the stream; the peer announces that port as its stage address. Each TCP
connection a trainer makes to the port is carried over the stream as frames (`open`, `data`,
`close`), and the peer connects it to its own stage service on this machine. The bytes go through
untouched: calls stay mutual TLS between trainer and peer (the trainer checks the peer's certificate
by its peer id, not by the address it dialled), and the relay sees ciphertext only.

Why not libp2p's circuit relays in hivemind's daemon: the stage service is gRPC over TCP, and p2pd
relays only libp2p streams. A TCP tunnel over the gRPC stream the peer opened carries it as it is.

Bounds: a relay serves at most `capacity` peers (RESOURCE_EXHAUSTED beyond), each with at most
MAX_CONNS connections at once; frames carry at most CHUNK bytes; a stream wants what joining wants
(the join token in a guarded run: UNAUTHENTICATED without it). A peer whose relay goes away attaches
again (to the same or the next relay it is given) within RETRY_S and announces the new address.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from swarm.identity import Member
from swarm.rpc import pb

log = logging.getLogger(__name__)

SERVICE = "swarm.Relay"
ATTACH = f"/{SERVICE}/Attach"
CHUNK = 64 * 1024
MAX_CONNS = 64  # connections at once through one relayed peer
QUEUE_FRAMES = 64  # frames buffered each way (4 MiB): a slow side holds the other back
RETRY_S = 5.0
END = None  # a queue's last item
ENCODE, DECODE = pb.RelayFrame.SerializeToString, pb.RelayFrame.FromString


def frames(out: queue.Queue, done: threading.Event) -> Iterator[pb.RelayFrame]:
    """The frames put on `out`, until END or `done`."""
    while not done.is_set():
        try:
            frame = out.get(timeout=0.5)
        except queue.Empty:
            continue
        if frame is END:
            return
        yield frame


def put(out: queue.Queue, frame: pb.RelayFrame, done: threading.Event) -> bool:
    """Put `frame` on `out`, waiting while it is full, unless the stream ends first (False)."""
    while not done.is_set():
        try:
            out.put(frame, timeout=0.5)
            return True
        except queue.Full:
            continue
    return False


def pump(sock: socket.socket, conn: int, out: queue.Queue, done: threading.Event) -> None:
    """Bytes read from `sock` as data frames of connection `conn` on `out`, then its close frame."""
    try:
        while not done.is_set():
            data = sock.recv(CHUNK)
            if not data or not put(out, pb.RelayFrame(conn=conn, data=data), done):
                break
    except OSError:
        pass
    finally:
        put(out, pb.RelayFrame(conn=conn, close=True), done)


class Conns:
    """The TCP connections carried over one stream, by id."""

    def __init__(self) -> None:
        self.socks: dict[int, socket.socket] = {}
        self.lock = threading.Lock()

    def add(self, conn: int, sock: socket.socket) -> None:
        with self.lock:
            self.socks[conn] = sock

    def deliver(self, frame: pb.RelayFrame) -> None:
        """A frame from the other side: its bytes into the connection, or the connection closed."""
        with self.lock:
            sock = self.socks.get(frame.conn)
        if sock is None:
            return
        try:
            if frame.data:
                sock.sendall(frame.data)
            if frame.close:
                self.drop(frame.conn)
        except OSError:
            self.drop(frame.conn)

    def drop(self, conn: int) -> None:
        with self.lock:
            sock = self.socks.pop(conn, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        for conn in list(self.socks):
            self.drop(conn)

    def __len__(self) -> int:
        return len(self.socks)


class RelayHub:
    """The relay's side: one listening port per attached peer, on `host`, announced as
    `announce_host`:port. `admit(context)` says why a caller may not attach (None: it may; no
    `admit`: anyone may): `bearer_admission` for the coordinator's relay, the run certificate's
    `Member.refusal` for a peer's (served over mutual TLS)."""

    def __init__(
        self,
        host: str,
        announce_host: str | None = None,
        capacity: int = 32,
        admit: Callable[[grpc.ServicerContext], str | None] | None = None,
    ):
        self.host, self.announce_host, self.capacity, self.admit = host, announce_host or host, capacity, admit
        self.attached: dict[str, str] = {}  # relayed address -> who attached (the peer's address seen)
        self.lock = threading.Lock()

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(
            self.attach,
            request_deserializer=pb.RelayFrame.FromString,
            response_serializer=pb.RelayFrame.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Attach": method})

    def attach(self, requests: Iterator[pb.RelayFrame], context: grpc.ServicerContext) -> Iterator[pb.RelayFrame]:
        if self.admit is not None and (refused := self.admit(context)) is not None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"this relay carries members of its run only: {refused}")
        listener = socket.create_server((self.host, 0))
        address = f"{self.announce_host}:{listener.getsockname()[1]}"
        with self.lock:
            if len(self.attached) >= self.capacity:
                listener.close()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay full: {self.capacity} peers attached")
            self.attached[address] = context.peer()
        log.info(f"relay: carrying {address} for {context.peer()}")
        out: queue.Queue = queue.Queue(QUEUE_FRAMES)
        done, conns = threading.Event(), Conns()
        context.add_callback(done.set)
        threading.Thread(target=self._accept, args=(listener, conns, out, done), daemon=True).start()
        threading.Thread(target=self._deliver, args=(requests, conns, out, done), daemon=True).start()
        try:
            yield pb.RelayFrame(address=address)
            yield from frames(out, done)
        finally:
            done.set()
            listener.close()
            conns.close()
            with self.lock:
                self.attached.pop(address, None)
            log.info(f"relay: {address} released")

    def _accept(self, listener: socket.socket, conns: Conns, out: queue.Queue, done: threading.Event) -> None:
        ids = itertools.count(1)
        listener.settimeout(0.5)
        while not done.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if len(conns) >= MAX_CONNS:
                sock.close()
                continue
            sock.settimeout(None)
            conn = next(ids)
            conns.add(conn, sock)
            if put(out, pb.RelayFrame(conn=conn, open=True), done):
                threading.Thread(target=pump, args=(sock, conn, out, done), daemon=True).start()

    @staticmethod
    def _deliver(requests: Iterator[pb.RelayFrame], conns: Conns, out: queue.Queue, done: threading.Event) -> None:
        try:
            for frame in requests:
                conns.deliver(frame)
        except grpc.RpcError:
            pass
        finally:
            done.set()
            with contextlib.suppress(queue.Full):
                out.put_nowait(END)


def bearer_admission(admit: Callable[[str], object]) -> Callable[[grpc.ServicerContext], str | None]:
    """An admission by the bearer token a call carries: `admit(token)` raises to refuse it."""

    def check(context: grpc.ServicerContext) -> str | None:
        scheme, _, token = dict(context.invocation_metadata()).get("authorization", "").partition(" ")
        try:
            admit(token if scheme == "Bearer" else "")
        except Exception as err:  # the admission's own refusal, whatever its type: said as it is
            return str(err) or type(err).__name__
        return None

    return check


def start_relay(
    hub: RelayHub, port: int = 0, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, int]:
    """A gRPC server of `hub` on its host and `port` (0: any free one); the server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=hub.capacity + 4, thread_name_prefix="relay"))
    server.add_generic_rpc_handlers((hub.handler(),))
    where = f"{hub.host}:{port}"
    bound = server.add_secure_port(where, credentials) if credentials is not None else server.add_insecure_port(where)
    if bound == 0:
        raise OSError(f"relay: cannot listen on {where}")
    server.start()
    return server, bound


class RelayLink:
    """The relayed peer's side: a thread that keeps a stream open to one of `relays` ((HOST:PORT, peer
    id), tried in turn: a peer's relay, with a peer id, over mutual TLS as `member`; the coordinator's,
    without, with the join token), connects each carried connection to `local` (this machine's stage
    service) and calls `on_address(HOST:PORT)` each time a relay announces where the swarm reaches
    this peer."""

    def __init__(
        self,
        relays: Callable[[], list[tuple[str, str | None]]],
        local: tuple[str, int],
        on_address: Callable[[str], None],
        join_token: str | None = None,
        member: Member | None = None,
    ):
        self.relays, self.local, self.on_address, self.join_token = relays, local, on_address, join_token
        self.member = member
        self.address: str | None = None
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="relay-link", daemon=True)

    def start(self) -> RelayLink:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            for relay, peer_id in self.relays() or []:
                if self.stop_event.is_set():
                    return
                try:
                    self._attach(relay, peer_id)
                except grpc.RpcError as err:
                    log.warning(f"relay {relay}: {err.code().name}: {err.details()}")
                except OSError as err:
                    log.warning(f"relay {relay}: {err}")
            self.stop_event.wait(RETRY_S)

    def _channel(self, relay: str, peer_id: str | None) -> grpc.Channel:
        if peer_id is not None and self.member is not None:
            credentials = self.member.channel_credentials()
            return grpc.secure_channel(relay, credentials, options=self.member.target_options(peer_id))
        return grpc.insecure_channel(relay)

    def _attach(self, relay: str, peer_id: str | None) -> None:
        out: queue.Queue = queue.Queue(QUEUE_FRAMES)
        done, conns = threading.Event(), Conns()
        token = self.join_token if peer_id is None else None  # a peer's relay knows members by certificate
        metadata = [("authorization", f"Bearer {token}")] if token else None
        with self._channel(relay, peer_id) as channel:
            call = channel.stream_stream(
                ATTACH,
                request_serializer=pb.RelayFrame.SerializeToString,
                response_deserializer=pb.RelayFrame.FromString,
            )(frames(out, done), metadata=metadata)
            threading.Thread(target=self._cancel_on_stop, args=(call, done), daemon=True).start()
            try:
                for frame in call:
                    if frame.address:
                        self.address = frame.address
                        log.info(f"relay {relay}: the swarm reaches this peer at {frame.address}")
                        self.on_address(frame.address)
                    elif frame.open:
                        self._open(frame.conn, conns, out, done)
                    else:
                        conns.deliver(frame)
            finally:
                done.set()
                conns.close()
                self.address = None

    def _cancel_on_stop(self, call: grpc.Future, done: threading.Event) -> None:
        while not done.wait(0.5):
            if self.stop_event.is_set():
                call.cancel()
                return

    def _open(self, conn: int, conns: Conns, out: queue.Queue, done: threading.Event) -> None:
        try:
            sock = socket.create_connection(self.local, timeout=5)
        except OSError:
            put(out, pb.RelayFrame(conn=conn, close=True), done)
            return
        sock.settimeout(None)
        conns.add(conn, sock)
        threading.Thread(target=pump, args=(sock, conn, out, done), daemon=True).start()


def wait_address(link: RelayLink, timeout: float) -> str | None:
    """The address `link` was given, once it has one (None after `timeout`)."""
    deadline = time.monotonic() + timeout
    while link.address is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return link.address
