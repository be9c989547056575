"""The CUDA paths: a stage worker in bf16 against float32 on CPU, checkpointed activations' peak
memory, the memory estimate against what a 125m stage really allocates, `swarm peer --dry-run`
on the GPU, and a 2 x 2 swarm of peers on the GPU whose replicas average (gradients with int8 or
PowerSGD, DiLoCo). Run on a GPU machine: `python -m pytest -q -m gpu tests/test_gpu.py`."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import pytest
import torch

from peer.requests import BackwardWork, ForwardWork
from peer.worker import StageWorker
from swarm import memory
from swarm.config import RunConfig, load_config
from swarm.device import device_name
from tests.conftest import ROOT
from tests.harness import state
from tests.test_averaging import averaging_swarm_of, train_and_assert_replicas_equal

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; CI has none — run on a GPU machine"
)
pytestmark = [pytest.mark.gpu, needs_cuda]
CUDA = torch.device("cuda")


def config(path: str, stages: int, checkpoint: bool = False, training: dict | None = None, **model) -> RunConfig:
    data = load_config(ROOT / "configs" / path).with_stages(stages).model_dump()
    data["model"].update(model, checkpoint_activations=checkpoint)
    data["training"].update(training or {})
    return RunConfig.model_validate(data)


def train(worker: StageWorker, x: torch.Tensor, grad: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`n` training forwards of `x`, each cached, then their backwards: the input gradients."""
    outs = []
    for i in range(n):
        outs.append(worker.submit(ForwardWork(x, None, True, 0.0, f"m{i}", 0)).result(timeout=300).output)
    grads = []
    for i in range(n):
        cached = worker.claim_cached(f"m{i}")
        assert cached is not None
        grads.append(worker.submit(BackwardWork(None, grad, f"m{i}", 0, tuple(x.shape), cached)).result(timeout=300))
    return outs + grads


def test_a_bf16_stage_worker_on_cuda_matches_float32_on_cpu():
    # The 125m model's dtype (bfloat16) at a size that also runs quickly on CPU.
    run = config("125m.toml", 3, d_model=256, n_heads=4, n_kv_heads=4, ffn_dim=1024, seq_len=256, n_layers=3)
    assert run.model.dtype == "bfloat16"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, run.model.seq_len, run.model.d_model, generator=gen)
    grad = torch.randn(2, run.model.seq_len, run.model.d_model, generator=gen) * 1e-3
    results = {}
    for device in (torch.device("cpu"), CUDA):
        worker = StageWorker(run, 1, device)
        try:
            out, input_grad = train(worker, x, grad, 1)
        finally:
            worker.close()
        results[device.type] = (out.float(), input_grad.float())
    for cpu, cuda in zip(results["cpu"], results["cuda"], strict=True):
        rel = (cuda - cpu).norm() / cpu.norm()
        assert rel < 2e-2, f"bf16 on CUDA differs from float32 on CPU by {rel:.3%}"  # bf16 keeps 8 bits


def peak_after_training(run: RunConfig, inflight: int) -> tuple[int, int]:
    """torch.cuda.max_memory_allocated over a stage worker's life, and what stays allocated between
    steps (weights, gradient buffers, AdamW's states): `inflight` microbatches forward (cached), then
    their backwards, for two global batches. AdamW's states exist from the first step on, so the
    second global batch's forwards meet them, as every later step's do."""
    gc.collect()  # an earlier worker's tensors that a reference cycle still holds
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(CUDA)
    base = torch.cuda.memory_allocated(CUDA)
    worker = StageWorker(run, 1, CUDA, cache_size=inflight)
    try:
        m, b = run.model, run.training.micro_batch
        x = torch.randn(b, m.seq_len, m.d_model)
        for _ in range(2 * run.training.accumulation // inflight):
            train(worker, x, torch.randn_like(x) * 1e-3, inflight)
        deadline = time.monotonic() + 60
        while worker.optimizer_steps < 2:  # a step (and AdamW's states) comes after the batch's last answer
            assert time.monotonic() < deadline, "no second optimizer step after two global batches"
            time.sleep(0.1)
        torch.cuda.synchronize(CUDA)
        resident = torch.cuda.memory_allocated(CUDA) - base
    finally:
        worker.close()
    peak = torch.cuda.max_memory_allocated(CUDA) - base
    del worker
    torch.cuda.empty_cache()
    return peak, resident


def run_125m(checkpoint: bool) -> RunConfig:
    # 8 microbatches of 8 x 1024 tokens per step: one step after two rounds of 4 in flight.
    return config("125m.toml", 3, checkpoint=checkpoint, training={"global_batch": 64})


def test_checkpointed_activations_lower_the_peak_memory_of_a_125m_stage():
    (stored, resident), (ckpt, ckpt_resident) = (peak_after_training(run_125m(c), inflight=4) for c in (False, True))
    # The same weights, gradients and optimizer states (checkpointing keeps a few small buffers: 3% on an H100)
    assert abs(ckpt_resident - resident) < 0.05 * resident
    # Above what stays between steps: the graphs of the microbatches in flight.
    stored, ckpt = stored - resident, ckpt - resident
    assert ckpt < 0.6 * stored, f"in flight: checkpointed {ckpt / 2**30:.2f} GiB vs stored {stored / 2**30:.2f} GiB"


@pytest.mark.parametrize("checkpoint", [False, True], ids=["stored", "checkpointed"])
def test_the_memory_estimate_of_a_125m_stage_is_close_to_the_measured_peak(checkpoint):
    run, inflight = run_125m(checkpoint), 4
    measured, resident = peak_after_training(run, inflight)
    print(f"peak {measured / 2**30:.2f} GiB, of which {resident / 2**30:.2f} GiB stays between steps")
    # The worker holds `inflight` cached graphs; the estimate adds the batch being computed.
    need = memory.estimate(run, 1, "cuda", memory.peer_inflight(run, inflight))
    print(f"estimated {need.tensors / 2**30:.2f} GiB\n{need.describe()}")
    # A peer refuses what it cannot hold, so the estimate errs on the safe side: it counts both gradient
    # buffers and one microbatch more than may be alive at the peak. Under by at most 20% (the overhead
    # allowance covers that), over by at most 50%.
    assert 0.8 * measured <= need.tensors <= 1.5 * measured, (
        f"estimated {need.tensors / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB\n{need.describe()}"
    )


def test_swarm_peer_dry_run_on_cuda_prints_the_estimates():
    done = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "peer", "--config", "configs/125m.toml", "--device", "cuda"]
        + ["--dry-run", "--inflight", "4"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "available on cuda" in done.stdout and done.stdout.count("stage ") >= 3
    assert "-> fits" in done.stdout


@pytest.mark.parametrize("spec", ["int8", "powersgd", "diloco int8"])
def test_a_two_by_two_swarm_on_cuda_averages_and_its_replicas_stay_bitwise_equal(tmp_path, spec):
    """Real processes: a coordinator, four peers on the GPU (two per stage) and a trainer. The weights
    and gradients live on the GPU, the averager's buffers in host memory."""
    swarm = averaging_swarm_of(tmp_path, spec)
    try:
        names = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}
        for name, stage in names.items():
            swarm.add_peer(name, stage, "--device", "cuda")
        swarm.wait_online(list(names), timeout=180)
        devices = {p["public_name"]: p["device"] for s in state(swarm.url)["stages"] for p in s["peers"]}
        assert set(devices.values()) == {device_name(CUDA)}, devices
        train_and_assert_replicas_equal(swarm, swarm.run, list(names), steps=6)
    finally:
        swarm.close()
