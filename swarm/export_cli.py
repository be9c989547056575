"""`swarm export` and `swarm generate`: their arguments and what they run (torch and the export code are
imported only when they run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swarm.arguments import add_join_token, http_url, non_negative_float, non_negative_int, positive_float, positive_int
from swarm.config import ConfigError


def add_commands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Add `swarm export` and `swarm generate` to `commands`; the parsers they made."""
    export = commands.add_parser(
        "export",
        help="gather the model from a live swarm into one Hugging Face checkpoint",
        description="Fetch every stage's weights from live peers (all at one optimizer step) and write a Hugging "
        "Face Llama checkpoint: model.safetensors, config.json, the run's tokenizer, swarm_export.json.",
    )
    export.add_argument("--coordinator", required=True, type=http_url, metavar="URL", help="the run's coordinator")
    export.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to write (created)")
    export.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty directory that is not a previous export (its other files are kept)",
    )
    export.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="seconds to wait for all stages to reach the same optimizer step (default 60)",
    )
    add_join_token(export, "the run's join token, if it has one")
    export.set_defaults(func=cmd_export)

    generate = commands.add_parser(
        "generate",
        help="sample text from an exported model",
        description="Load an export (swarm export --out DIR) on this machine's CPU and continue a prompt.",
    )
    generate.add_argument("--model", required=True, type=Path, metavar="DIR", help="the export's directory")
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    generate.add_argument(
        "--max-new-tokens", type=positive_int, default=200, metavar="N", help="tokens to generate (default 200)"
    )
    generate.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.8,
        metavar="T",
        help="sampling temperature; 0 takes the most likely token (default 0.8)",
    )
    generate.add_argument(
        "--top-k",
        type=non_negative_int,
        default=40,
        metavar="K",
        help="sample among the K likeliest tokens; 0: among all (default 40)",
    )
    generate.add_argument("--seed", type=non_negative_int, default=0, metavar="S", help="random seed (default 0)")
    generate.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    generate.set_defaults(func=cmd_generate)
    return [export, generate]


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.export import export_swarm

    export_swarm(
        args.coordinator,
        args.out,
        timeout=args.timeout,
        note=lambda text: print(text, flush=True),
        force=args.force,
        join_token=args.join_token,
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from swarm.generate import load_export, sample
    from swarm.tokenizer import load_tokenizer

    if not args.prompt:
        raise ConfigError("--prompt: must not be empty")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, run = load_export(args.model)
    tokenizer = load_tokenizer(run.data.tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {args.model}: {parameters:,} parameters, vocabulary {tokenizer.vocab_size}, "
        f"context {run.model.seq_len} tokens",
        file=sys.stderr,
    )
    start = time.perf_counter()
    text, count = sample(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
    )
    print(args.prompt + text, flush=True)
    print(f"{count} tokens in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
