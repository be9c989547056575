"""`swarm tokenizer`: its arguments and what it runs (the tokenizers package is imported only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.arguments import data_path, positive_int, ready_file_path


def add_commands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Add `swarm tokenizer` and its actions to `commands`; the parsers it made."""
    tokenizer = commands.add_parser(
        "tokenizer",
        help="train a tokenizer for a run ([data] tokenizer = its file)",
        description="Make a tokenizer.json for a run's [data] tokenizer.",
    )
    tokenizer_actions = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION", prog="swarm tokenizer")
    train_tok = tokenizer_actions.add_parser(
        "train",
        help="fit a byte-level BPE to text files",
        description="Fit a byte-level BPE (the tokenizers package; any text encodes, <|endoftext|> is its special "
        "token) to a text file or a folder of text files, read one file at a time, and write it as tokenizer.json.",
    )
    train_tok.add_argument(
        "--data", required=True, type=data_path, metavar="PATH", help="a text file, or a folder of text files"
    )
    train_tok.add_argument(
        "--vocab-size", required=True, type=positive_int, metavar="N", help="tokens, 257 (bytes + 1) or more"
    )
    train_tok.add_argument(
        "--out", required=True, type=ready_file_path, metavar="FILE", help="the tokenizer.json to write"
    )
    train_tok.set_defaults(func=cmd_tokenizer_train)
    return [tokenizer, train_tok]


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from swarm.tokenizer import train_from_files

    print(train_from_files(Path(args.data), args.vocab_size, args.out), flush=True)
    return 0
