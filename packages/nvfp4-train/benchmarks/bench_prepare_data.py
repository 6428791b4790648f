"""Throughput of `nvfp4-train prepare-data` with a GPT-2-size byte-level BPE, and its ceiling.

The tokenizer is a byte-level BPE with GPT-2's vocabulary size (50,257 entries, GPT-2's
pre-tokenizer), trained with `tokenizers` on the Python sources and docs of this environment's
site-packages (no download; pass `--tokenizer` to use another, e.g. GPT-2's own `tokenizer.json`).
The corpus is the King James Bible (the built-in corpus) repeated `--repeat` times, chapter order
shuffled per repetition, written once as JSON Lines and once as parquet.

Measured, interleaved `--repeats` times (median reported): `encode_batch` alone on the same texts in
the same 1,024-document batches (the ceiling: the Rust encoder on every core, no reading or
writing), and `prepare_corpus` end to end from each format (reading, tokenizing, writing shards,
hashing). Prints a table, writes JSON and (with --md) Markdown.

    python packages/nvfp4-train/benchmarks/bench_prepare_data.py --md docs/benchmarks/prepare_data.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from nvfp4_train.data import kjv_chapters, prepare_corpus
from nvfp4_train.data.prepare import BATCH_RECORDS

EOS = "<|endoftext|>"
GPT2_VOCAB = 50257


def _site_packages_text(limit_bytes: int) -> list[str]:
    root = Path(np.__file__).parents[1]
    texts, total = [], 0
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".md", ".rst", ".txt") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="ignore")
            texts.append(text)
            total += len(text)
            if total >= limit_bytes:
                break
    return texts


def train_gpt2_size_bpe(out: Path) -> Path:
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=GPT2_VOCAB, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    hf.train_from_iterator(_site_packages_text(64 << 20), trainer=trainer)
    file = out / "tokenizer.json"
    hf.save(str(file))
    return file


def write_corpus(out: Path, repeat: int) -> tuple[Path, Path, list[str]]:
    chapters = kjv_chapters()
    rng = np.random.default_rng(0)
    docs = [chapters[i] for _ in range(repeat) for i in rng.permutation(len(chapters))]
    jsonl = out / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    parquet = out / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=4096)
    return jsonl, parquet, docs


def time_ceiling(tokenizer: Path, docs: list[str]) -> tuple[float, int]:
    hf = tokenizers.Tokenizer.from_file(str(tokenizer))
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(docs), BATCH_RECORDS):
        tokens += sum(len(e.ids) for e in hf.encode_batch(docs[i : i + BATCH_RECORDS]))
    return time.perf_counter() - start, tokens


def time_prepare(tokenizer: Path, source: Path, out: Path) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = prepare_corpus([source], tokenizer=tokenizer, output=out, shard_tokens=10_000_000)
    return time.perf_counter() - start, manifest["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=8, help="copies of the KJV (4.1 MB each)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/prepare_data.json"))
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        tokenizer = args.tokenizer or train_gpt2_size_bpe(work)
        trained_s = time.perf_counter() - start
        vocab = tokenizers.Tokenizer.from_file(str(tokenizer)).get_vocab_size()
        jsonl, parquet, docs = write_corpus(work, args.repeat)
        rounds: dict[str, list[float]] = {"encode_batch (ceiling)": [], "jsonl": [], "parquet": []}
        counts = {}
        for _ in range(args.repeats):
            for name, run in (
                ("encode_batch (ceiling)", lambda: time_ceiling(tokenizer, docs)),
                ("jsonl", lambda: time_prepare(tokenizer, jsonl, work / "out")),
                ("parquet", lambda: time_prepare(tokenizer, parquet, work / "out")),
            ):
                seconds, counts[name] = run()
                rounds[name].append(seconds)
        text_bytes = sum(len(d.encode("utf-8")) for d in docs)
    rows = []
    for name, times in rounds.items():
        median = statistics.median(times)
        rows.append({"path": name, "tokens": counts[name], "median_s": median,
                     "tokens_per_s": counts[name] / median, "times_s": times})  # fmt: skip
    result = {
        "tokenizer": str(args.tokenizer) if args.tokenizer else "byte-level BPE trained here",
        "vocab_size": vocab, "tokenizer_training_s": None if args.tokenizer else trained_s,
        "documents": len(docs), "text_bytes": text_bytes, "repeats": args.repeats,
        "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "tokenizers_version": tokenizers.__version__, "rows": rows,
    }  # fmt: skip
    lines = [
        f"{len(docs):,} documents, {text_bytes / 1e6:.1f} MB of text, vocab {vocab:,}, "
        f"{os.cpu_count()} cores, median of {args.repeats}",
        "",
        "| path | tokens | seconds (median) | tokens/s |",
        "|---|---:|---:|---:|",
        *(f"| {r['path']} | {r['tokens']:,} | {r['median_s']:.2f} | "
          f"{r['tokens_per_s'] / 1e6:.2f}M |" for r in rows),
    ]  # fmt: skip
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        intro = [
            "# prepare-data throughput (`bench_prepare_data.py`)",
            "",
            __doc__.split("\n\n")[1].replace("\n", " "),
            "",
            __doc__.split("\n\n")[2].replace("\n", " "),
            "",
        ]
        args.md.write_text("\n".join([*intro, *lines]) + "\n")


if __name__ == "__main__":
    main()
