"""`nvfp4-train prepare-data`: the command-line face of `nvfp4_train.data.prepare`.

    nvfp4-train prepare-data INPUT [INPUT ...] --tokenizer tokenizer.json -o OUT_DIR
        [--text-field text] [--eos-token '<|endoftext|>'] [--shard-tokens 100000000]

Shows a progress bar (input bytes, documents, tokens, tokens/s, ETA) and ends with a summary.
Interrupted, the same command resumes from the last written shard.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    prepare = sub.add_parser(
        "prepare-data",
        help="tokenize parquet / JSON Lines / text files into token shards (data.source=tokens)",
    )
    prepare.add_argument(
        "inputs", type=Path, nargs="+", metavar="INPUT",
        help="parquet, .jsonl / .json (optionally .gz) or .txt files, or directories of them",
    )  # fmt: skip
    prepare.add_argument(
        "--tokenizer", type=Path, required=True,
        help="a tokenizer.json (Hugging Face tokenizers), or a directory holding one",
    )  # fmt: skip
    prepare.add_argument("-o", "--output", type=Path, required=True, help="the corpus directory")
    prepare.add_argument(
        "--text-field", default="text", help="the parquet column / JSON field of the text"
    )
    prepare.add_argument(
        "--eos-token", default="<|endoftext|>",
        help="the separator written after every document (a token of the tokenizer)",
    )  # fmt: skip
    prepare.add_argument(
        "--shard-tokens", type=int, default=100_000_000,
        help="a shard ends at the first document end at or past this many tokens",
    )  # fmt: skip


def run_prepare(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from nvfp4_train.data.prepare import Progress as PrepareProgress
    from nvfp4_train.data.prepare import prepare_corpus

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%  {task.fields[documents]:,} docs  "
                   "{task.fields[tokens]:,} tokens  {task.fields[rate]}"),
        TimeRemainingColumn(),
    )  # fmt: skip
    start = time.perf_counter()
    with Progress(*columns) as bar:
        task = bar.add_task("prepare-data", total=None, documents=0, tokens=0, rate="")

        def report(p: PrepareProgress) -> None:
            rate = p.tokens / max(time.perf_counter() - start, 1e-9)
            bar.update(task, total=p.bytes_total, completed=p.bytes_done, documents=p.documents,
                       tokens=p.tokens, rate=f"{rate / 1e6:.2f}M tok/s")  # fmt: skip

        manifest = prepare_corpus(
            args.inputs,
            tokenizer=args.tokenizer,
            output=args.output,
            text_field=args.text_field,
            eos_token=args.eos_token,
            shard_tokens=args.shard_tokens,
            report=report,
        )
    seconds = time.perf_counter() - start
    print(
        f"{args.output}: {manifest['tokens']:,} tokens ({manifest['dtype']}), "
        f"{manifest['documents']:,} documents, {len(manifest['shards'])} shard(s) from "
        f"{len(manifest['sources'])} file(s) in {seconds:.1f} s; train on it with "
        f"data.source=tokens data.path={args.output}"
    )
    return 0
