"""`python -m benchmarks outer`: DiLoCo's outer step on its own, over several seeds, in one process.

A swarm run mixes what the outer update costs with timing (which replica serves which microbatch
follows it), and one run per setting cannot show the spread between runs. Here R replicas of the
whole model train in one process, each on its share of every global batch (microbatch i goes to
replica i mod R, as pinned paths with R replicas per stage give), H AdamW steps apart, as
`peer/diloco.py` steps them; then their pseudo-gradients (the outer weights minus theirs) go
through the averaging compression (peer/allreduce.py's codec, as the all-reduce sends a part and hands
back the average), are averaged, and the outer optimizer of `swarm/optim.py` steps the outer
weights, which every replica takes. The reference is the same loop with one replica and no outer
step: the reference trainer's update (`swarm train --local` gives the same losses at seed 0).

For each seed (`training.seed`: the model's initial weights and the data order) and variant
(`--variants`, named as the averaging benchmark names them: `COMPRESSION/dilocoH[-lrLR][-mM]`):
- final loss = mean training loss of the last `--tail` steps, over the replicas' batches;
- val = the held-out loss of the final outer weights on `--eval-batches` micro-batches (the steps
  are rounded to a multiple of every variant's H so that the last step is an outer step);
- ratio = the variant's ÷ the reference's at the same seed. One row per variant: the mean ratio
  over the seeds, and the lowest and highest.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from tqdm import tqdm

from benchmarks.common import averaging_spec
from benchmarks.results import append_row
from peer.allreduce import COMPRESSIONS, as_received
from swarm.config import RunConfig, load_config
from swarm.data import TrainStream
from swarm.model import Stage, lm_loss
from swarm.optim import make_optimizer, make_outer_optimizer, param_groups
from swarm.schedule import lr_at
from swarm.trainer.local import evaluate

# The codecs whose outer step this benchmark can replay: every averaging compression but PowerSGD,
# whose low-rank rounds keep state of their own.
CODECS = tuple(c for c in COMPRESSIONS if c != "powersgd")
SECTION = "outer: DiLoCo's outer step in one process, R whole-model replicas ÷ the reference update, over seeds"
COLUMNS = [
    "config",
    "replicas",
    "variant",
    "steps",
    "seeds",
    "ratio (mean)",
    "ratio (min - max)",
    "val ratio (mean)",
    "val ratio (min - max)",
    "notes",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=6, help="seeds 0 .. N-1")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--variants",
        type=variants,
        default=variants("int8/diloco10-lr0.7-m0.5,int8/diloco10-lr1-m0"),
        help=f"comma-separated COMPRESSION/dilocoH[-lrLR][-mM] (compression one of {', '.join(CODECS)})",
    )
    p.add_argument("--tail", type=int, default=10, help="final loss = mean of the last N steps")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def variants(text: str) -> list[dict]:
    found = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        settings = averaging_spec(item)
        if settings.get("mode") != "diloco" or settings["compression"] not in CODECS:
            raise argparse.ArgumentTypeError(
                f"{item!r}: COMPRESSION/dilocoH[-lrLR][-mM], COMPRESSION one of {', '.join(CODECS)}"
            )
        if settings.get("paths") == "pinned":
            raise argparse.ArgumentTypeError(f"{item!r}: -pinned means nothing here (each replica is a whole model)")
        found.append({"name": item, **settings})
    if not found:
        raise argparse.ArgumentTypeError("no variant given")
    return found


def with_outer(run: RunConfig, settings: dict, seed: int) -> RunConfig:
    averaging = {k: v for k, v in settings.items() if k in type(run.averaging).model_fields}
    return run.model_copy(
        update={
            "training": run.training.model_copy(update={"seed": seed}),
            "averaging": run.averaging.model_copy(update=averaging),
        }
    )


def train(run: RunConfig, steps: int, replicas: int, tail: int, eval_batches: int, bar: tqdm) -> tuple[float, float]:
    """(final training loss, held-out loss of the final weights) of `replicas` replicas averaged every
    `inner_steps` steps, or of the reference update (`replicas` 1, no outer step)."""
    t, a = run.training, run.averaging
    torch.manual_seed(t.seed)
    data = TrainStream.local(run.data, run.model.seq_len, t.seed)
    val = data.val_batches(eval_batches, t.micro_batch)
    outer_module = Stage(run, 0)
    models = [copy.deepcopy(outer_module) for _ in range(replicas)]
    inner = [make_optimizer(param_groups(m, t.weight_decay), run) for m in models]
    outer = make_outer_optimizer(outer_module.parameters(), run) if replicas > 1 else None
    losses = []
    for step in range(steps):
        batches = [data.next_microbatch(t.micro_batch) for _ in range(t.accumulation)]
        step_losses = []
        for r, (model, opt) in enumerate(zip(models, inner, strict=True)):
            mine = batches[r::replicas]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, t)
            for b in mine:
                loss = lm_loss(model(b.inputs), b.targets)
                (loss / len(mine)).backward()
                step_losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        for b in batches:
            data.trained(b)
        losses.append(sum(step_losses) / len(step_losses))
        if outer is not None and (step + 1) % a.inner_steps == 0:
            outer_step(outer_module, models, outer, a.compression)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    final_weights = outer_module if outer is not None else models[0]
    return sum(losses[-tail:]) / tail, evaluate(final_weights, val, torch.device("cpu"), run.model.dtype)


@torch.no_grad()
def outer_step(outer_module: Stage, models: list[Stage], outer: torch.optim.Optimizer, codec: str) -> None:
    """The replicas' pseudo-gradients, each sent through `codec`, averaged, the average sent back
    through it; the outer step; every replica takes the outer weights."""
    sent = lambda x: as_received(COMPRESSIONS[codec], x.detach().contiguous()).to(x.dtype)  # noqa: E731
    params = [list(m.parameters()) for m in models]
    for i, p in enumerate(outer_module.parameters()):
        p.grad = sent(sum(sent(p - mine[i]) for mine in params) / len(models))
    outer.step()
    outer.zero_grad(set_to_none=True)
    for mine in params:
        for p, q in zip(outer_module.parameters(), mine, strict=True):
            q.copy_(p)


def spread(ratios: list[float]) -> tuple[str, str]:
    return f"{statistics.fmean(ratios):.4f}", f"{min(ratios):.4f} - {max(ratios):.4f}"


def run(args: argparse.Namespace) -> str:
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_config(args.config).with_stages(1)
    lcm = math.lcm(*(v["inner_steps"] for v in args.variants))
    steps = max(lcm, args.steps - args.steps % lcm)
    runs = args.seeds * (1 + len(args.variants))
    print(f"outer: {args.config}, {steps} steps, {args.replicas} replicas, seeds 0-{args.seeds - 1}, {runs} runs")
    ratios: dict[str, list[tuple[float, float]]] = {v["name"]: [] for v in args.variants}
    started = time.monotonic()
    with tqdm(total=runs * steps, unit="step", desc="outer") as bar:
        for seed in range(args.seeds):
            reference = train(with_outer(base, {}, seed), steps, 1, args.tail, args.eval_batches, bar)
            for v in args.variants:
                ours = train(with_outer(base, v, seed), steps, args.replicas, args.tail, args.eval_batches, bar)
                ratios[v["name"]].append((ours[0] / reference[0], ours[1] / reference[1]))
                bar.write(
                    f"seed {seed} {v['name']}: final loss {ours[0]:.4f} ({ratios[v['name']][-1][0]:.4f}x the "
                    f"reference's {reference[0]:.4f}), held-out {ours[1]:.4f} ({ratios[v['name']][-1][1]:.4f}x)"
                )
    rows = []
    for v in args.variants:
        (mean, span), (val_mean, val_span) = (spread([r[k] for r in ratios[v["name"]]]) for k in (0, 1))
        print(f"{v['name']}: {mean}x the reference's final loss ({span}), held-out {val_mean}x ({val_span})")
        rows.append(
            append_row(
                SECTION,
                COLUMNS,
                [
                    args.config,
                    args.replicas,
                    v["name"],
                    steps,
                    args.seeds,
                    mean,
                    span,
                    val_mean,
                    val_span,
                    f"outer_lr {v.get('outer_lr', base.averaging.outer_lr):g}, outer momentum "
                    f"{v.get('outer_momentum', base.averaging.outer_momentum):g}; final loss = mean of the last "
                    f"{args.tail} steps; val on {args.eval_batches} held-out batches; microbatch i to replica i mod "
                    f"{args.replicas}; {time.monotonic() - started:.0f} s for the whole run",
                ],
            )
        )
    return "\n".join(rows)
