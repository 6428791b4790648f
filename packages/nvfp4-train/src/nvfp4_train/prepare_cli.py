"""`nvfp4-train prepare-data`: the command-line face of `nvfp4_train.data.prepare`.

    nvfp4-train prepare-data INPUT [INPUT ...] --tokenizer tokenizer.json -o OUT_DIR
        [--text-field text] [--eos-token '<|endoftext|>'] [--shard-tokens 100000000]

Shows a progress bar (input bytes, documents, tokens, tokens/s of this run, ETA) and ends with a
summary: totals, this run's tokens and speed, the files taken and skipped (with the reason), and
the separators found as text. Interrupted, the same command resumes from the last written shard.
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


SHOWN = 10
"""Files the summary names of each list (taken, skipped); manifest.json lists them all."""


def _listed(title: str, entries: list[str]) -> list[str]:
    more = [f"  ... and {len(entries) - SHOWN:,} more (manifest.json lists all)"]
    return [title, *(f"  {e}" for e in entries[:SHOWN]), *(more if len(entries) > SHOWN else [])]


def summary(output: Path, manifest: dict, seconds: float, resumed: tuple[int, float] | None) -> str:
    """The lines printed after prepare-data: totals, this run's speed, the files taken and
    skipped, and the separators found as text."""
    sources, skipped = manifest["sources"], manifest.get("skipped", [])
    lines = [
        f"{output}: {manifest['tokens']:,} tokens ({manifest['dtype']}), "
        f"{manifest['documents']:,} documents, {len(manifest['shards'])} shard(s) from "
        f"{len(sources)} file(s) in {seconds:.1f} s; train on it with "
        f"data.source=tokens data.path={output}"
    ]
    if resumed is None:
        lines.append("already prepared: inputs, tokenizer and shards checked against manifest.json")
    else:
        tokens = manifest["tokens"] - resumed[0]
        done = f" (resumed: {resumed[0]:,} tokens were prepared before)" if resumed[0] else ""
        lines.append(
            f"this run: {tokens:,} tokens, {tokens / max(resumed[1], 1e-9) / 1e6:.2f}M tokens/s{done}"
        )
    lines += _listed(f"took {len(sources)} file(s):", [s["path"] for s in sources])
    if skipped:
        lines += _listed(
            f"skipped {len(skipped)}:", [f"{s['path']}: {s['reason']}" for s in skipped]
        )
    literal = manifest.get("literal_separators", 0)
    if literal:
        lines.append(
            f"{literal:,} time(s) the text held {manifest['tokenizer']['eos_token']!r}: encoded as "
            "text, never as the separator (manifest.json: literal_separators)"
        )
    return "\n".join(lines)


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
    first: list = []  # (tokens, time) when this run started: what earlier runs did is not speed
    bar = Progress(*columns)  # shown from the first report: an error before it prints no bar
    task = bar.add_task("prepare-data", total=None, documents=0, tokens=0, rate="")

    def report(p: PrepareProgress) -> None:
        if not first:  # the bar starts where this run starts: no jump counted as speed
            first.append((p.tokens, time.perf_counter()))
            bar.reset(task, total=p.bytes_total, completed=p.bytes_done)
            bar.start()
        rate = (p.tokens - first[0][0]) / max(time.perf_counter() - first[0][1], 1e-9)
        bar.update(task, total=p.bytes_total, completed=p.bytes_done, documents=p.documents,
                   tokens=p.tokens, rate=f"{rate / 1e6:.2f}M tok/s")  # fmt: skip

    try:
        manifest = prepare_corpus(
            args.inputs,
            tokenizer=args.tokenizer,
            output=args.output,
            text_field=args.text_field,
            eos_token=args.eos_token,
            shard_tokens=args.shard_tokens,
            report=report,
        )
    finally:
        if first:
            bar.stop()
    now = time.perf_counter()
    resumed = (first[0][0], now - first[0][1]) if first else None
    print(summary(args.output, manifest, now - start, resumed))
    return 0
