"""Gradient-norm shares pushed straight between the stages' peers.

At every global step each stage needs the other stages' squared gradient norms (peer/norm_exchange.py
NormExchange). Through the DHT alone a share took 1 to 2 s to be stored and found on a loaded 2-core
machine: a second or more of every step of every multi-stage swarm, on the critical path, whether or
not the stage had replicas to average with. So a replica also pushes its share to every member of
the other stages over its DHT node's own libp2p connections (a hivemind P2P protobuf handler; one
call per member, milliseconds on a LAN), and each DHT process keeps the shares pushed to it. The DHT
records stay as they were: whoever a push did not reach still finds the share there.

A pushed share is trusted no more than a DHT record: its sender is the connection's authenticated
peer id (never a field of the message), and a reader counts a share only when that peer is a member
of the stage the share names (swarm.records.stage_norms). What senders can make a node keep is
bounded: each sender's last KEEP shares, of the last MAX_SENDERS senders.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import Iterable

import hivemind
from hivemind.p2p import PeerID
from pydantic import ValidationError

from swarm.records import NormShare
from swarm.rpc import swarm_pb2 as pb

log = logging.getLogger("swarm.norms")

HANDLER = "swarm.NormSharePush"
KEEP = 16  # shares kept per sender: a few steps of each run it takes part in
MAX_SENDERS = 1024  # beyond this, the sender heard from longest ago is forgotten
PUSH_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 1.0
SERVE_TIMEOUT_S = 30.0  # a DHT process that does not answer at start-up is not waited for longer

# In each DHT process: sender's peer id (base58) -> its last shares (run id, stage, step, squared),
# the sender heard from last at the end.
_received: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()


def serve(dht: hivemind.DHT) -> bool:
    """Have `dht`'s process keep the shares pushed to it (at most once per DHT process). False when it
    could not: the shares then come through the DHT records alone."""
    try:
        dht.run_coroutine(_serve, return_future=True).result(timeout=SERVE_TIMEOUT_S)
        return True
    except Exception as err:  # e.g. the DHT process is gone or does not answer
        log.warning(f"norm shares come through the DHT records only: {err!r}")
        return False


async def _serve(_dht, node) -> None:
    """In the DHT process (`DHT.run_coroutine` pickles what it runs, so these live at module level)."""
    if getattr(node, "_swarm_norm_shares", False):
        return

    async def handle(request: pb.NormSharePush, context) -> pb.NormShareAck:
        keep(context.remote_id.to_base58(), request)
        return pb.NormShareAck()

    await node.p2p.add_protobuf_handler(HANDLER, handle, pb.NormSharePush)
    node._swarm_norm_shares = True


def keep(sender: str, message: pb.NormSharePush) -> None:
    """Keep `sender`'s share (in the DHT process)."""
    shares = _received.pop(sender, None) or collections.deque(maxlen=KEEP)
    shares.append((message.run_id, message.stage, message.step, message.squared))
    _received[sender] = shares
    while len(_received) > MAX_SENDERS:
        _received.popitem(last=False)


def push(dht: hivemind.DHT, run_id: str, share: NormShare, peers: Iterable[str]) -> None:
    """Push `share` to each of `peers` (DHT peer ids, base58; the sender itself is skipped), without
    waiting for them: a peer the push does not reach reads the DHT record instead."""
    targets = sorted(set(peers) - {share.peer_id})
    if not targets:
        return
    message = pb.NormSharePush(run_id=run_id, stage=share.stage, step=share.step, squared=share.squared)
    with contextlib.suppress(Exception):  # the DHT process is gone: nothing to push through
        dht.run_coroutine(
            functools.partial(_push, targets=targets, message=message.SerializeToString()), return_future=True
        )


async def _push(_dht, node, targets: list[str], message: bytes) -> None:
    request = pb.NormSharePush.FromString(message)

    async def one(peer: str) -> None:
        call = node.p2p.call_protobuf_handler(PeerID.from_base58(peer), HANDLER, request, pb.NormShareAck)
        await asyncio.wait_for(call, PUSH_TIMEOUT_S)

    await asyncio.gather(*(one(p) for p in targets), return_exceptions=True)


def received(dht: hivemind.DHT, run_id: str, step: int) -> list[NormShare]:
    """The well-formed shares of `run_id`'s global `step` pushed to this node (none when its DHT process
    does not answer in time), each with its sender's peer id."""
    try:
        found = dht.run_coroutine(functools.partial(_received_of, run_id=run_id, step=step), return_future=True)
        found = found.result(timeout=READ_TIMEOUT_S)
    except Exception:
        return []
    shares = []
    for sender, stage, squared in found:
        with contextlib.suppress(ValidationError):  # e.g. a negative or non-finite norm
            shares.append(NormShare(peer_id=sender, stage=stage, step=step, squared=squared))
    return shares


async def _received_of(_dht, _node, run_id: str, step: int) -> list[tuple[str, int, float]]:
    return [
        (sender, stage, squared)
        for sender, shares in _received.items()
        for r, stage, s, squared in shares
        if r == run_id and s == step
    ]
