"""A peer's options, built once from the command line (swarm/cli.py) and passed down as they are.

`Faults` holds what only tests set: a peer that stands in for a slower device, one that lies about
its outputs, one that logs the microbatches each optimizer step applied. A normal peer has none
(`Faults()`), and the code that injects them lives here, out of the worker's normal path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Faults:
    """Test-only behaviour of a peer; the defaults are a normal peer."""

    delay_per_sample: float = 0.0  # seconds added per sample served: a slower device
    # A dishonest peer: Gaussian noise of this scale (x the outputs' RMS) added to its forward outputs.
    corrupt_outputs: float = 0.0
    # A hostile peer: every tensor it answers with is one token short ("shape") or all NaN ("nan").
    malformed: str | None = None
    # A faulty peer: the weight gradients it computes come out NaN (an overflow, a bad device), the
    # answers it sends stay finite.
    non_finite_grads: bool = False
    log_steps: Path | None = None  # one JSON line per optimizer step, naming the microbatches it applied

    def delay(self, samples: int) -> None:
        """Take as long as a slower device would have taken over `samples` more."""
        if self.delay_per_sample:
            time.sleep(self.delay_per_sample * samples)

    def slowed(self, samples_per_s: float) -> float:
        """A measured throughput as the stand-in for a slower device would have measured it (forward
        and backward each take `delay_per_sample` longer per sample)."""
        if not self.delay_per_sample:
            return samples_per_s
        return 1 / (1 / samples_per_s + 2 * self.delay_per_sample)

    def corrupt(self, out: torch.Tensor) -> torch.Tensor:
        if not self.corrupt_outputs:
            return out
        with torch.no_grad():
            noise = torch.randn_like(out) * (self.corrupt_outputs * out.float().pow(2).mean().sqrt())
        return out + noise

    def spoil(self, module: torch.nn.Module) -> None:
        """Make the gradient `module` just accumulated not finite, when this peer is the faulty kind."""
        if self.non_finite_grads:
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            grad.fill_(float("nan"))

    def answer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor this peer sends back in place of `tensor`."""
        if self.malformed == "shape":
            return tensor[:, :-1]
        if self.malformed == "nan":
            return torch.full_like(tensor, float("nan"))
        return tensor


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
    checkpoint_dir: Path | None = None  # None: no checkpoints saved or loaded
    checkpoint_every: int = 50  # optimizer steps between checkpoints
    join_token: str | None = None  # the run's join token, asked of every call to this peer too
    join_wait: float = 0.0  # seconds to keep trying a coordinator that does not answer
    ready_file: Path | None = None  # rewritten whenever the peer starts serving a stage (swarm/ready.py)
    inflight: int | None = None  # forward graphs kept for their backward (None: the run's serve.cache_size)
    max_memory: int | None = None  # bytes a stage may take on the device, below what it has (None: all it has)
    faults: Faults = NO_FAULTS
