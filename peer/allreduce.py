"""What a stage's all-reduce sends, and how every replica ends with the same bits.

hivemind's all-reduce splits the averaged tensors into parts, one reducer per part: each member sends
its part to the part's reducer, which averages and sends back the difference between the average and
that member's part (`AllReduceRunner`, return_deltas), which the member adds to its own tensor. That
difference is compressed like everything sent: with a lossy codec every member ends a slightly
different average (its own part plus its own rounding), the replicas' weights part, and the weights
digests (peer/replica_check.py ReplicaCheck) make the minority reload the stage's state at every step.
`ExactAllReduceRunner` has each reducer send the average itself, compressed once, and keep for its own
part what the others decode: every member copies in the same values.

`[averaging] compression`: "none" sends the float32 buffers (4 bytes a value), "fp16" 2, "int8" a
byte a value plus a float32 scale per block of 256 (the wire codec's, swarm/wire.py), "int4" half a
byte a value plus the same scales (for DiLoCo's pseudo-gradients; not a wire codec); "powersgd"
sends two low-rank factors of each weight matrix in float32 (peer/hivemind_compat.py). The reducer
adds up the decoded parts in float32 and encodes the average once: a replica's error is that of one
encode of its part (weighted) and one of the average.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.averaging.allreduce import AllReduceRunner, BannedException
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression, serialization
from hivemind.proto import averaging_pb2, runtime_pb2

from swarm.wire import INT8_BLOCK, _int4_decode, _int4_encode, _int8_decode, _int8_encode

log = logging.getLogger("swarm.averaging")


class BlockCompression(CompressionBase):
    """Signed codes in blocks of INT8_BLOCK values, a float32 scale (absmax / the largest code) per
    block (swarm/wire.py): the error of a value is at most half its block's scale. "int8": codes
    -127 .. 127, a byte each; "int4": -7 .. 7, two a byte.

    int8 travels as hivemind's BLOCKWISE_8BIT type and int4 as its UNIFORM_8BIT type, whose codecs are
    replaced by these in every process that imports this module (all of a stage's replicas): hivemind's
    own 8-bit codecs fail to decode under numpy >= 2.4 (Uniform8Bit, Quantile8Bit: int() of a 1-element
    array) or need bitsandbytes, a CUDA library (Blockwise), and it has no 4-bit type."""

    def __init__(self, type_name: str, encode, decode, bytes_per_value: float):
        self.compression_type = runtime_pb2.CompressionType.Value(type_name)
        self.encode, self.decode, self.bytes_per_value = encode, decode, bytes_per_value
        serialization._BASE_COMPRESSION_TYPES[type_name] = self

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        values = tensor.detach()
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=self.encode(values),
            size=values.shape,
            dtype=str(values.dtype).removeprefix("torch."),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        dtype = getattr(torch, serialized_tensor.dtype)
        return self.decode(serialized_tensor.buffer, shape).to(dtype)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bytes_per_value / 4  # of float32 values


COMPRESSIONS: dict[str, CompressionBase] = {
    "none": NoCompression(),
    "fp16": Float16Compression(),
    "int8": BlockCompression("BLOCKWISE_8BIT", _int8_encode, _int8_decode, 1 + 4 / INT8_BLOCK),
    "int4": BlockCompression("UNIFORM_8BIT", _int4_encode, _int4_decode, 0.5 + 4 / INT8_BLOCK),
    # The factors P and Q of PowerSGD (peer/hivemind_compat.py CappedPowerSGDAverager), and the tensors it
    # leaves whole (biases, norms), go as float32: the low rank is the compression.
    "powersgd": NoCompression(),
}


def as_received(compression: CompressionBase, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a member decodes it after `compression`."""
    return serialization.deserialize_torch_tensor(compression.compress(tensor, CompressionInfo.from_tensor(tensor)))


class ExactAllReduceRunner(AllReduceRunner):
    """hivemind 1.1.12's AllReduceRunner, but for what a reducer hands back: the average of the part,
    compressed with the averager's codec, and for its own part the same values decoded; the member's
    outputs are values to copy in, not differences to add (a part whose reducer failed keeps the
    member's own values, as before).

    `start_timeout`: a member that has not begun to send its parts this long after this one began is
    left out of the round, as a sender and as a reducer. hivemind waits `sender_timeout` for it, and
    then up to `reducer_timeout` for the parts it was to reduce; but a member that is that late has
    not begun at all: the leader counted it in the group and it never learned so (its join request
    failed as the leader answered: a libp2p stream reset under load), and it goes on looking for a
    group. A 2 x 2 swarm's round then held both replicas for the whole stall bound (6 s), and the
    other stage waited as long for their gradient norm."""

    def __init__(
        self, *args, compression: CompressionBase, reduced_bytes, start_timeout: float | None = None, **kwargs
    ):
        super().__init__(*args, compression=compression, **kwargs)
        self.start_timeout = start_timeout
        self.talks: dict = {}  # peer id -> the task that sends it its part and receives the average
        self.compression = compression
        self.tensor_part_container.return_deltas = False
        # Bytes of the parts this member reduced for others: received, and their averages sent back.
        # Every byte of a round has one reducer at one end: summed over the members, the round's traffic.
        # Added as they pass to `reduced_bytes` (the averager's multiprocessing.Value): the last averages
        # a member sends may leave after its own tensors are done.
        self.reduced_bytes = reduced_bytes

    def _count(self, n: int) -> None:
        with self.reduced_bytes.get_lock():
            self.reduced_bytes.value += n

    async def _handle_missing_senders(self):
        """hivemind's, but within `start_timeout` when set, and a member left out as a sender is left
        out as a reducer too: this member stops waiting for the average of its part (keeping its own
        values there, as for any failed reducer)."""
        timeout = self.sender_timeout
        if self.start_timeout is not None:
            timeout = self.start_timeout if timeout is None else min(timeout, self.start_timeout)
        try:
            await asyncio.wait_for(self.all_senders_started.wait(), timeout)
        except TimeoutError:
            for peer_id in self.sender_peer_ids:
                if peer_id not in self.active_senders and peer_id not in self.banned_senders:
                    log.warning(f"peer {peer_id} did not begin its part of the all-reduce in {timeout:g} s: left out")
                    await self._ban_sender(peer_id)
                    talk = self.talks.get(peer_id)
                    if talk is not None:
                        talk.cancel()  # it registers the peer as a failed reducer as it ends

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            self.talks[peer_id] = asyncio.current_task()
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            received = await loop.run_in_executor(None, as_received, self.compression, averaged)
            self.tensor_part_container.register_processed_part(peer_index, part_index, received)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for msg in stream:
                self._count(len(msg.tensor_part.buffer))
                tensor_part = await loop.run_in_executor(None, serialization.deserialize_torch_tensor, msg.tensor_part)
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=msg.weight
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was banned: its parts are no longer aggregated
                info = CompressionInfo.from_tensor(averaged)
                serialized = await loop.run_in_executor(None, self.compression.compress, averaged, info)
                self._count(len(serialized.buffer))
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
