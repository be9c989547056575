"""Peer checkpoints: what is saved comes back bit for bit, only a matching and intact checkpoint is
ever loaded, the disk never holds up the worker, and a restarted peer resumes from its checkpoint
when (and only when) it is newer than what the live peers of its stage hold."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import torch

from peer.checkpoint import (
    META,
    WEIGHTS,
    Checkpoint,
    CheckpointError,
    CheckpointWriter,
    Snapshot,
    latest_checkpoint,
    stage_dir,
    write_checkpoint,
)
from peer.local_updater import LocalUpdater
from peer.requests import ForwardWork
from peer.worker import StageWorker
from swarm.config import RunConfig, load_config, parse_config
from swarm.model import Stage
from tests.conftest import CONFIGS, run_cli
from tests.harness import ACCUMULATION, Swarm, peer_record
from tests.processes import wait_for_state
from tests.test_averaging import FAST_AVERAGING, config_with, parameters

RUN = load_config(CONFIGS / "tiny.toml")
LAST = RUN.stages.count - 1


def trained(steps: int, run: RunConfig = RUN, stage: int = LAST) -> LocalUpdater:
    """A stage after `steps` AdamW steps on random data (non-zero moments)."""
    updater = LocalUpdater(run, Stage(run, stage))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(2, run.model.seq_len, run.model.d_model, generator=gen)
        updater.module(x).float().pow(2).mean().backward()
        updater.step(run.training.global_batch)
    return updater


def snapshot(updater: LocalUpdater) -> Snapshot:
    return Snapshot.take(updater.module, updater.optimizer, updater.epoch, updater.outer_optimizer)


def assert_same_state(a: LocalUpdater, b: LocalUpdater) -> None:
    for (name, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, stats in sa["state"].items():
        assert stats.keys() == sb["state"][i].keys()
        for key, t in stats.items():
            assert torch.equal(t, sb["state"][i][key]), (i, key)
    assert a.epoch == b.epoch


def other_config(**model):
    data = RUN.model_dump()
    data["model"].update(model)
    return parse_config(data)


# -- on disk -------------------------------------------------------------------------------------


def test_a_checkpoint_gives_back_weights_optimizer_state_and_step_bit_for_bit(tmp_path):
    source = trained(steps=3)
    path = write_checkpoint(tmp_path, RUN, LAST, snapshot(source))
    assert path == tmp_path / "tiny" / f"stage{LAST}" / "step00000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "checkpoint.json",
        "optimizer.json",
        "optimizer.safetensors",
        "weights.safetensors",
    ]

    found = latest_checkpoint(tmp_path, RUN, LAST)
    assert found is not None and found.step == 3
    assert {k: found.meta[k] for k in ("run_id", "stage", "layers", "step", "model_hash", "version")} == {
        "run_id": "tiny",
        "stage": LAST,
        "layers": list(RUN.stage_layers(LAST)),
        "step": 3,
        "model_hash": RUN.model_hash(),
        "version": 1,
    }
    assert found.meta["saved_at"] <= time.time()

    resumed = LocalUpdater(RUN, Stage(RUN, LAST))
    assert resumed.load_checkpoint(found) == "checkpoint step 3"
    assert_same_state(source, resumed)
    assert isinstance(resumed.optimizer.param_groups[0]["betas"], tuple)

    # ... and both take the same next step: nothing the optimizer needs was left behind.
    x = torch.randn(2, RUN.model.seq_len, RUN.model.d_model)
    for updater in (source, resumed):
        updater.module(x).float().pow(2).mean().backward()
        updater.step(RUN.training.global_batch)
    assert_same_state(source, resumed)


def test_a_checkpoint_of_another_run_stage_or_model_is_never_loaded(tmp_path, caplog):
    write_checkpoint(tmp_path, RUN, LAST, snapshot(trained(steps=1)))
    assert latest_checkpoint(tmp_path, RUN, LAST) is not None

    # Another model under the same run id: the model hash differs.
    wider = other_config(ffn_dim=256)
    assert latest_checkpoint(tmp_path, wider, LAST) is None
    assert "model_hash" in caplog.text
    # The same model cut differently: stage 1 owns other layers.
    resplit = RUN.with_stages(2, layers=[3, 1])
    assert latest_checkpoint(tmp_path, resplit, LAST) is None
    # A folder copied where another stage's or another run's checkpoints go is still refused.
    src = stage_dir(tmp_path, "tiny", LAST)
    shutil.copytree(src, stage_dir(tmp_path, "tiny", 0))
    assert latest_checkpoint(tmp_path, RUN, 0) is None
    other_run = parse_config(dict(RUN.model_dump(), run_id="other"))
    shutil.copytree(src, stage_dir(tmp_path, "other", LAST))
    assert latest_checkpoint(tmp_path, other_run, LAST) is None
    assert "run_id is 'tiny', this peer needs 'other'" in caplog.text


def test_a_truncated_or_partial_checkpoint_is_skipped_for_the_one_before(tmp_path, caplog):
    updater = trained(steps=2)
    write_checkpoint(tmp_path, RUN, LAST, snapshot(updater))
    updater.epoch = 4  # a later step's folder, to be damaged
    newest = write_checkpoint(tmp_path, RUN, LAST, snapshot(updater))
    weights = newest / WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    found = latest_checkpoint(tmp_path, RUN, LAST)
    assert found is not None and found.step == 2
    assert "skipping checkpoint" in caplog.text and "step00000004" in caplog.text and "damaged" in caplog.text
    # Loading the damaged folder directly is refused too (safetensors sees the truncation).
    try:
        Checkpoint(newest, 4, {}).load()
    except CheckpointError as err:
        assert WEIGHTS in str(err) or "step00000004" in str(err)
    else:
        raise AssertionError("a truncated weights file was loaded")

    # A folder without its checkpoint.json (not written by this code, or damaged) is skipped alike.
    (newest / META).unlink()
    caplog.clear()
    assert latest_checkpoint(tmp_path, RUN, LAST).step == 2
    assert "no readable checkpoint.json" in caplog.text

    # Saving that step again replaces the damaged folder.
    write_checkpoint(tmp_path, RUN, LAST, snapshot(updater))
    assert latest_checkpoint(tmp_path, RUN, LAST).step == 4


def test_only_the_newest_checkpoints_are_kept_and_dead_writers_leftovers_go(processes, tmp_path):
    folder = stage_dir(tmp_path, "tiny", LAST)
    # Another model saved under the same run id, further on: not this peer's to prune.
    wider = other_config(ffn_dim=256)
    foreign = trained(steps=1, run=wider)
    foreign.epoch = 100
    write_checkpoint(tmp_path, wider, LAST, snapshot(foreign), keep=1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = folder / f".tmp-{int(gone.stdout)}-step00000001"  # a writer killed mid-write
    leftover.mkdir()

    updater = trained(steps=1)
    for step in (2, 4, 6):
        updater.epoch = step
        write_checkpoint(tmp_path, RUN, LAST, snapshot(updater), keep=2)
    assert sorted(p.name for p in folder.iterdir()) == ["step00000004", "step00000006", "step00000100"]
    assert latest_checkpoint(tmp_path, RUN, LAST).step == 6


# -- in the background ---------------------------------------------------------------------------


def test_a_slow_disk_never_holds_up_the_worker_and_a_busy_writer_skips_a_checkpoint(tmp_path):
    release = threading.Event()
    writers: list[threading.Thread] = []

    def slow_disk(snapshot: Snapshot) -> None:
        writers.append(threading.current_thread())
        release.wait(60)

    notes: list[str] = []
    writer = CheckpointWriter(tmp_path, RUN, LAST, every=1, note=notes.append, before_write=slow_disk)
    worker = StageWorker(RUN, LAST, torch.device("cpu"), checkpoints=writer)
    gen = torch.Generator().manual_seed(1)
    micro, steps = RUN.training.micro_batch, 3
    try:
        for step in range(steps):
            for i in range(RUN.training.accumulation):
                x = torch.randn(micro, RUN.model.seq_len, RUN.model.d_model, generator=gen)
                targets = torch.randint(0, RUN.model.vocab_size, (micro, RUN.model.seq_len), generator=gen)
                scale = micro / RUN.training.global_batch
                work = ForwardWork(x, targets, True, scale, f"{step}.{i}", step)
                assert worker.submit(work).result(timeout=60).loss > 0
        deadline = time.monotonic() + 60
        while worker.optimizer_steps < steps and time.monotonic() < deadline:
            time.sleep(0.05)
        # The worker served and stepped on while the first checkpoint was stuck on its way to disk.
        assert worker.optimizer_steps == steps
        assert writer.saved == [] and latest_checkpoint(tmp_path, RUN, LAST) is None
        assert writer.skipped == [2, 3]
        assert len([n for n in notes if "skipped" in n]) == 1, notes  # said once

        release.set()
        assert writer.wait_idle(60)
        assert writer.saved == [1] and latest_checkpoint(tmp_path, RUN, LAST).step == 1
        assert writers and all(t is not threading.main_thread() and t is not worker._thread for t in writers)
    finally:
        release.set()
        worker.close()


def test_steps_offered_past_a_multiple_of_the_period_are_checkpointed_at_the_first_after_it(tmp_path):
    """A DiLoCo replica offers only the steps that end a phase (here every 3rd), and a replica that
    skipped steps jumps over some: one is written at the first step offered at or after each
    multiple of `every`, and none twice in one period."""
    writer = CheckpointWriter(tmp_path, RUN, LAST, every=5)
    updater = trained(1)
    try:
        for step in (3, 6, 9, 12, 15, 16, 24, 26):
            writer.offer(step, lambda s=step: Snapshot.take(updater.module, updater.optimizer, s, None))
            assert writer.wait_idle(60)
        assert writer.saved == [6, 12, 15, 24, 26], writer.saved  # (the old rule, step % every == 0: [15])
    finally:
        writer.close()


# -- the command line ----------------------------------------------------------------------------


def test_an_unwritable_checkpoint_dir_or_a_zero_period_is_refused_at_start(processes, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    # The coordinator is never asked: the folder is checked first.
    done = run_cli("peer", "--coordinator", "http://127.0.0.1:9", "--checkpoint-dir", str(blocker / "ckpt"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--checkpoint-dir: cannot write to" in done.stderr and str(blocker) in done.stderr

    done = run_cli("peer", "--coordinator", "http://127.0.0.1:9", "--checkpoint-every", "0", timeout=60)
    assert done.returncode == 2 and "--checkpoint-every" in done.stderr


# -- a real swarm --------------------------------------------------------------------------------


def wait_for_checkpoint(root, run, stage: int, step: int, timeout: float = 30) -> Checkpoint:
    deadline = time.monotonic() + timeout
    while True:
        found = latest_checkpoint(root, run, stage)
        if found is not None and found.step >= step:
            return found
        assert time.monotonic() < deadline, f"no checkpoint of stage {stage} at step {step} within {timeout} s"
        time.sleep(0.2)


def test_a_killed_peer_restarted_resumes_from_its_checkpoint_and_training_goes_on(processes, tmp_path):
    path, run = config_with(tmp_path, FAST_AVERAGING)
    ckpt = tmp_path / "ckpt"
    options = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    swarm = Swarm(tmp_path, path)
    try:
        swarm.add_peer("s0", 0, *options)
        swarm.add_peer("s1", 1, *options)
        swarm.wait_online(["s0", "s1"])
        swarm.train(steps=6)
        swarm.finish_training()
        saved = {k: wait_for_checkpoint(ckpt, run, k, 6) for k in (0, 1)}
        assert {k: c.step for k, c in saved.items()} == {0: 6, 1: 6}
        # keep = 2: steps 4 and 6 are left of 2, 4 and 6
        assert sorted(p.name for p in stage_dir(ckpt, "tiny", 1).iterdir()) == ["step00000004", "step00000006"]

        swarm.peers["s1"].stop(signal.SIGKILL)  # the whole process group: no goodbye, no last checkpoint
        # Its record says "online at step 6" until it expires, as much as the checkpoint holds: the
        # new peer first asks the live peers, gets nothing from the dead one, and takes the checkpoint.
        swarm.add_peer("s1b", 1, *options)
        s = swarm.wait_online(["s1b"])
        record = peer_record(s, "s1b")
        assert record["weights_from"] == "checkpoint step 6", record
        assert record["optimizer_steps"] == 6
        served_step, weights = parameters(swarm.url, run, record)
        assert served_step == 6
        expected = saved[1].load().weights
        assert weights.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(weights[name], t), name

        # A trainer starts at the swarm's step, and both stages go on from there together.
        swarm.train(steps=4)
        records = swarm.finish_training()
        assert [r["step"] for r in records] == [6, 7, 8, 9]
        assert records[-1]["microbatches"] == 4 * ACCUMULATION  # every microbatch issued completed once
        assert "Traceback" not in swarm.trainer.output()
        assert wait_for_checkpoint(ckpt, run, 1, 10).step == 10  # the new peer checkpoints in turn
        assert "no gradient norm" not in swarm.peers["s1b"].output()  # the stages' steps agree
    finally:
        swarm.close()


def test_a_peer_takes_the_live_peers_state_when_they_are_ahead_of_its_checkpoint(processes, tmp_path):
    path, run = config_with(tmp_path, FAST_AVERAGING)
    ckpt = tmp_path / "ckpt"
    swarm = Swarm(tmp_path, path)
    try:
        swarm.add_peer("s0", 0, "--checkpoint-dir", "none")
        swarm.add_peer("a1", 1, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4")
        swarm.wait_online(["s0", "a1"])
        swarm.train(steps=6)
        swarm.finish_training()
        assert wait_for_checkpoint(ckpt, run, 1, 4).step == 4  # the stage went on to step 6
        assert not (ckpt / "tiny" / "stage0").exists()  # 'none': no checkpoints

        swarm.add_peer("b1", 1, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4")
        s = swarm.wait_online(["b1"])
        record = peer_record(s, "b1")
        assert record["weights_from"] == "peers of stage 1 at step 6", record
        assert record["optimizer_steps"] == 6
        live = parameters(swarm.url, run, peer_record(s, "a1"))[1]
        assert all(torch.equal(parameters(swarm.url, run, record)[1][n], t) for n, t in live.items())
        assert "resumed stage" not in swarm.peers["b1"].output()
    finally:
        swarm.close()


def test_a_replica_behind_a_resumed_checkpoint_takes_the_state_from_the_resumed_peer(processes, tmp_path):
    path, run = config_with(tmp_path, FAST_AVERAGING)
    ckpt = tmp_path / "ckpt"
    swarm = Swarm(tmp_path, path)
    try:
        swarm.add_peer("s0", 0, "--checkpoint-dir", "none")
        swarm.add_peer("a1", 1, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
        swarm.wait_online(["s0", "a1"])
        swarm.train(steps=4)
        swarm.finish_training()
        wait_for_checkpoint(ckpt, run, 1, 4)
        # Its record says step 4 before it dies: a record left at step 3 (refreshed every REFRESH_S) lives
        # on for TTL_S, and with the newcomer's 0 it outvoted the resumed peer's 4 (the trainer began at 3).
        wait_for_state(swarm.url, lambda s: peer_record(s, "a1")["optimizer_steps"] == 4, timeout=30)
        swarm.peers["a1"].stop(signal.SIGKILL)

        # A newcomer without checkpoints finds no live state: it starts stage 1 from the seeded init.
        swarm.add_peer("fresh1", 1, "--checkpoint-dir", "none")
        s = swarm.wait_online(["fresh1"])
        assert peer_record(s, "fresh1")["weights_from"] == "the seeded init"
        # The peer with the checkpoint comes back: its step 4 is ahead of the newcomer's 0, so it
        # resumes there; a trainer starts at the swarm's step 4, and the newcomer, behind, takes the
        # stage's state from the resumed peer through hivemind.
        swarm.add_peer("a1b", 1, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
        s = swarm.wait_online(["a1b"])
        assert peer_record(s, "a1b")["weights_from"] == "checkpoint step 4"
        swarm.train(steps=2)
        assert [r["step"] for r in swarm.finish_training()] == [4, 5]
        deadline = time.monotonic() + 30
        while True:
            (step_a, a), (step_f, f) = (parameters(swarm.url, run, peer_record(s, n)) for n in ("a1b", "fresh1"))
            if step_a == step_f == 6 and all(torch.equal(a[n], f[n]) for n in a):
                break
            assert time.monotonic() < deadline, f"the replicas hold steps {step_a} and {step_f}"
            time.sleep(0.5)
        assert re.search(r"caught up to step [4-6] from peers of stage 1", swarm.peers["fresh1"].output())
    finally:
        swarm.close()
