"""A peer's options, built once from the command line (peer/cli.py) and passed down as they are.

`Faults` holds what only tests set: a peer that stands in for a slower device, one that lies about
its outputs or its step, one that logs the microbatches each optimizer step applied, one that keeps moving
between stages. A normal peer has none
(`Faults()`), and the code that injects them lives here, out of the worker's normal path.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.config import RunConfig


@dataclass(frozen=True)
class Faults:
    """Test-only behaviour of a peer; the defaults are a normal peer."""

    delay_per_sample: float = 0.0  # seconds added per sample served: a slower device
    # A dishonest peer: noise of this scale (x the outputs' RMS) added to its forward outputs, a
    # function of the outputs alone, so that two liars given the same input tell the same lie (Sybils).
    corrupt_outputs: float = 0.0
    # ... that lies only where it expects no spot check, after answering its first `lie_after` training
    # forwards honestly (a new peer's calls are all checked): it knows the run's config and how a
    # trainer once picked its checks (`predicted_check`). None: it lies in every answer.
    lie_after: int | None = None
    # A dishonest peer: noise of this scale (x the gradient's RMS) added to the input gradients it answers
    # in training calls (Backward, the last stage's Forward); its outputs and losses are honest, and so
    # are its answers to spot checks (`check` calls: a liar could tell those apart).
    corrupt_grads: float = 0.0
    # A hostile peer: every tensor it answers with is one token short ("shape") or all NaN ("nan").
    malformed: str | None = None
    # A faulty peer: the weight gradients it computes come out NaN (an overflow, a bad device), the
    # answers it sends stay finite.
    non_finite_grads: bool = False
    log_steps: Path | None = None  # one JSON line per optimizer step, naming the microbatches it applied
    # A restless peer: moves to the next stage at every rebalancing check, whatever the swarm needs
    # (what a move leaves behind, tested without waiting for the swarm to need one).
    restless: bool = False
    # A slow link: taking a stage's state (on joining, and on a move) takes this many seconds longer, so
    # that what a peer does meanwhile can be watched.
    state_delay_s: float = 0.0
    # A hostile peer: says its stage took this many optimizer steps, in its record and its answers.
    claim_steps: int | None = None
    # A hostile peer: declares this many samples toward each of its stage's steps (to hivemind's progress
    # tracker, and as its weight in the stage's all-reduce), and hands in no gradient (zeros): weighed as
    # it claims, it would be the whole average, and its stage would stop learning.
    declare_samples: int | None = None
    _forwards: list[int] = field(default_factory=lambda: [0], compare=False)  # training forwards answered

    def delay(self, samples: int) -> None:
        """Take as long as a slower device would have taken over `samples` more."""
        if self.delay_per_sample:
            time.sleep(self.delay_per_sample * samples)

    def slow_download(self) -> None:
        if self.state_delay_s:
            time.sleep(self.state_delay_s)

    def slowed(self, samples_per_s: float) -> float:
        """A measured throughput as the stand-in for a slower device would have measured it (forward
        and backward each take `delay_per_sample` longer per sample)."""
        if not self.delay_per_sample:
            return samples_per_s
        return 1 / (1 / samples_per_s + 2 * self.delay_per_sample)

    def lies(self, run: RunConfig, stage: int, works: Sequence) -> list[bool]:
        """Which of a batch's forwards (peer/requests.py ForwardWork) this peer answers falsely."""
        if not self.corrupt_outputs:
            return [False] * len(works)
        if self.lie_after is None:
            return [True] * len(works)
        lying = []
        for work in works:
            if work.train:
                self._forwards[0] += 1
            trusted = self._forwards[0] > self.lie_after
            lying.append(work.train and trusted and not predicted_check(run, stage, work.microbatch_id))
        return lying

    def corrupt(self, out: torch.Tensor, rows: Sequence[bool] | None = None) -> torch.Tensor:
        """`out` with its samples (first dimension) corrupted where `rows` says (None: all of them)."""
        if not self.corrupt_outputs or (rows is not None and not any(rows)):
            return out
        with torch.no_grad():
            noise = torch.sin(out.float() * 37.0 + 1.0) * (self.corrupt_outputs * out.float().pow(2).mean().sqrt())
            if rows is not None:
                noise *= torch.tensor(rows, dtype=noise.dtype, device=noise.device).view(-1, *[1] * (out.dim() - 1))
        return out + noise.to(out.dtype)

    def spoil(self, module: torch.nn.Module) -> None:
        """Make the gradient `module` just accumulated not finite, or zero, when this peer is of the
        faulty or the hostile kind."""
        if self.non_finite_grads:
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            grad.fill_(float("nan"))
        if self.declare_samples is not None:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def declared(self, samples: int) -> int:
        """The samples this peer declares toward its stage's step, holding `samples`."""
        return samples if self.declare_samples is None else self.declare_samples

    def claimed_steps(self, steps: int) -> int:
        """The optimizer steps this peer says its stage took (or reached), having taken `steps`."""
        return steps if self.claim_steps is None else self.claim_steps

    def answer_grad(self, grad: torch.Tensor, check: bool) -> torch.Tensor:
        """The input gradient this peer sends back in place of `grad` (`check`: a spot check's)."""
        if self.corrupt_grads and not check:
            grad = grad + torch.sin(grad * 1e4 + 1.0) * (self.corrupt_grads * grad.pow(2).mean().sqrt())
        return self.answer(grad)

    def answer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor this peer sends back in place of `tensor`."""
        if self.malformed == "shape":
            return tensor[:, :-1]
        if self.malformed == "nan":
            return torch.full_like(tensor, float("nan"))
        return tensor


def predicted_check(run: RunConfig, stage: int, microbatch_id: str) -> bool:
    """A liar's guess whether a trainer checks this training forward, from what a peer sees: an id
    ending in "STEP.INDEX" once told which calls a hash of the run's seed picked. An opaque id tells
    nothing: the guess is then "not checked"."""
    name = microbatch_id.rsplit("-", 1)[-1]
    if not re.fullmatch(r"\d+\.\d+", name) or run.verify.fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{run.training.seed}/{stage}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < run.verify.fraction


NO_FAULTS = Faults()


@dataclass(frozen=True)
class PeerOptions:
    """How `swarm peer --coordinator URL` joins its run and serves (the flags of the same names)."""

    coordinator: str
    stage: int | None = None  # None: the least served stage
    host: str = "127.0.0.1"  # the address to listen on
    port: int = 0  # the stage service's port (0: any free one)
    dht_port: int = 0  # the DHT node's port (0: any free one)
    announce_host: str | None = None  # the address others reach this peer at, when not `host`
    device: str | None = None  # None: auto
    public_name: str = ""  # '': the end of the peer id
    threads: int | None = None  # torch CPU threads (None: torch's choice)
    rebalance: bool = True  # move to the stage the swarm needs most
    relay: int = 0  # relay this many peers that nobody can dial (swarm/relay.py; 0: none)
    checkpoint_dir: Path | None = None  # None: no checkpoints saved or loaded
    checkpoint_every: int = 50  # optimizer steps between checkpoints
    join_token: str | None = None  # the run's join token, asked of every call to this peer too
    join_wait: float = 0.0  # seconds to keep trying a coordinator that does not answer
    ready_file: Path | None = None  # rewritten whenever the peer starts serving a stage (swarm/ready.py)
    inflight: int | None = None  # forward graphs kept for their backward (None: the run's serve.cache_size)
    max_memory: int | None = None  # bytes a stage may take on the device, below what it has (None: all it has)
    faults: Faults = NO_FAULTS
