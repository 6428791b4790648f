"""Throughput of `nvfp4-train prepare-data` with a GPT-2-size byte-level BPE, on three corpora.

The tokenizer is a byte-level BPE with GPT-2's vocabulary size (50,257 entries, GPT-2's
pre-tokenizer), trained with `tokenizers` on the first 64 MB of the Python sources and docs of this
environment's site-packages (no download; pass `--tokenizer` to use another, e.g. GPT-2's own
`tokenizer.json`). The corpora, each about `--megabytes` of text, written once as JSON Lines and
once as parquet: `kjv` the King James Bible (the built-in corpus) repeated, chapter order shuffled
per repetition (what earlier versions of this benchmark measured: a 13k-word vocabulary, repeated);
`zipf` generated English-like prose that never repeats: sentences of words drawn from a Zipf
distribution (exponent 1.05) over the 100,000 most frequent words of site-packages text the
tokenizer did not see, with numbers; `code` the next site-packages files after the tokenizer's
training text (real, unrepeated Python and docs, one file a document).

Measured, interleaved `--repeats` times: the best wall time (on a shared machine, the run least
slowed by others) and the median CPU time of the process, all threads (tokens per CPU-second
hardly depends on what else runs): `encode_batch` alone on the same texts in
the same 1,024-document batches (the ceiling: the Rust encoder on every core, no reading or
writing), and `prepare_corpus` end to end from each format (reading, tokenizing, writing shards,
hashing). Per corpus it also counts how many of its pre-tokens (GPT-2 pre-tokenizer pieces) fall
on the first 10,000 distinct ones: the `tokenizers` BPE caches the merges of the first 10,000
distinct pre-tokens it meets and never evicts, so that share is its cache hit rate. Prints a table,
writes JSON and (with --md) Markdown.

    python packages/nvfp4-train/benchmarks/bench_prepare_data.py --md docs/benchmarks/prepare_data.md
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
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
TRAIN_BYTES = 64 << 20
CACHE_CAPACITY = 10_000  # tokenizers/src/utils/cache.rs DEFAULT_CACHE_CAPACITY
WORD = re.compile(r"[A-Za-z][a-z]{1,20}")


def _site_packages_files(skip_bytes: int, limit_bytes: int) -> list[str]:
    """The texts of site-packages' .py/.md/.rst/.txt files in path order, after `skip_bytes`."""
    root = Path(np.__file__).parents[1]
    texts, seen = [], 0
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".md", ".rst", ".txt") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="ignore")
            seen += len(text)
            if seen > skip_bytes and text.strip():
                texts.append(text)
            if seen >= skip_bytes + limit_bytes:
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
    hf.train_from_iterator(_site_packages_files(0, TRAIN_BYTES), trainer=trainer)
    file = out / "tokenizer.json"
    hf.save(str(file))
    return file


def kjv_documents(megabytes: float) -> list[str]:
    chapters = kjv_chapters()
    rng = np.random.default_rng(0)
    repeat = max(1, round(megabytes * 1e6 / sum(map(len, chapters))))
    return [chapters[i] for _ in range(repeat) for i in rng.permutation(len(chapters))]


def code_documents(megabytes: float) -> list[str]:
    return _site_packages_files(TRAIN_BYTES, int(megabytes * 1e6))


def zipf_documents(megabytes: float) -> list[str]:
    """Prose that never repeats: ~3 KB documents of sentences of Zipf-distributed words."""
    counts = collections.Counter(
        w.lower() for text in _site_packages_files(2 * TRAIN_BYTES, 48 << 20)
        for w in WORD.findall(text)
    )  # fmt: skip
    words = np.array([w for w, _ in counts.most_common(100_000)])
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, words.size + 1) ** 1.05
    stream = iter(words[rng.choice(words.size, size=int(megabytes * 1e6 / 4), p=p / p.sum())])
    docs, size = [], 0
    while size < megabytes * 1e6:
        sentences = []
        for _ in range(rng.integers(10, 40)):
            picked = [next(stream) for _ in range(rng.integers(6, 30))]
            if rng.random() < 0.3:
                number = str(rng.integers(0, 10 ** rng.integers(1, 6)))
                picked.insert(int(rng.integers(len(picked))), number)
            sentences.append(" ".join(picked).capitalize() + rng.choice([".", ".", "?", ";"]))
        docs.append(" ".join(sentences))
        size += len(docs[-1])
    return docs


CORPORA = {"kjv": kjv_documents, "zipf": zipf_documents, "code": code_documents}


def cache_share(tokenizer: Path, docs: list[str]) -> tuple[int, float]:
    """(distinct pre-tokens, share of pre-token occurrences among the first CACHE_CAPACITY distinct)."""
    pre = tokenizers.Tokenizer.from_file(str(tokenizer)).pre_tokenizer
    first: set[str] = set()
    seen: set[str] = set()
    hits = total = 0
    for doc in docs:
        for piece, _ in pre.pre_tokenize_str(doc):
            if piece not in seen:
                seen.add(piece)
                if len(first) < CACHE_CAPACITY:
                    first.add(piece)
            hits += piece in first
            total += 1
    return len(seen), hits / total


def write_corpus(out: Path, docs: list[str]) -> tuple[Path, Path]:
    out.mkdir()
    jsonl = out / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    parquet = out / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=4096)
    return jsonl, parquet


def _timed(run) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the process, all its threads, tokens) of `run()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = run()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def time_ceiling(tokenizer: Path, docs: list[str]) -> tuple[float, float, int]:
    hf = tokenizers.Tokenizer.from_file(str(tokenizer))

    def encode() -> int:
        batches = range(0, len(docs), BATCH_RECORDS)
        return sum(
            len(e.ids) for i in batches for e in hf.encode_batch(docs[i : i + BATCH_RECORDS])
        )

    return _timed(encode)


def time_prepare(tokenizer: Path, source: Path, out: Path) -> tuple[float, float, int]:
    shutil.rmtree(out, ignore_errors=True)
    return _timed(
        lambda: prepare_corpus([source], tokenizer=tokenizer, output=out, shard_tokens=10_000_000)[
            "tokens"
        ]
    )


def _byte_batches(docs: list[str], size: int) -> list[list[str]]:
    batches, batch, used = [], [], 0
    for doc in docs:
        batch.append(doc)
        used += len(doc)
        if used >= size:
            batches.append(batch)
            batch, used = [], 0
    return [*batches, batch] if batch else batches


def interleaved(corpora: dict[str, list[str]], tokenizer: Path, repeats: int) -> list[dict]:
    """The encoder alone on every corpus, alternating 1 MB batches of each, every batch timed
    `repeats` times: the sum of each batch's best time is what a quiet machine would take (the
    others' load falls on all corpora alike, and a batch's best run is its least disturbed)."""
    hf = tokenizers.Tokenizer.from_file(str(tokenizer))
    batches = {name: _byte_batches(docs, 1 << 20) for name, docs in corpora.items()}
    best = {name: [float("inf")] * len(b) for name, b in batches.items()}
    tokens = dict.fromkeys(corpora, 0)
    for _ in range(repeats):
        for i in range(max(map(len, batches.values()))):
            for name, chunks in batches.items():
                if i < len(chunks):
                    start = time.perf_counter()
                    count = sum(len(e.ids) for e in hf.encode_batch(chunks[i]))
                    best[name][i] = min(best[name][i], time.perf_counter() - start)
                    tokens[name] += count
    rows = []
    for name in corpora:
        seconds, count = sum(best[name]), tokens[name] // repeats
        rows.append({"corpus": name, "tokens": count, "seconds": seconds,
                     "tokens_per_s": count / seconds})  # fmt: skip
    return rows


def measure(corpora: dict[str, list[str]], tokenizer: Path, work: Path, repeats: int) -> list[dict]:
    """Every path on every corpus, interleaved `repeats` times (the machine's load hits all alike)."""
    runs = {}
    for name, docs in corpora.items():
        jsonl, parquet = write_corpus(work / name, docs)
        runs[name, "encode_batch (ceiling)"] = lambda docs=docs: time_ceiling(tokenizer, docs)
        runs[name, "jsonl"] = lambda f=jsonl: time_prepare(tokenizer, f, work / "out")
        runs[name, "parquet"] = lambda f=parquet: time_prepare(tokenizer, f, work / "out")
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    cpu: dict[tuple, list[float]] = {key: [] for key in runs}
    counts = {}
    for _ in range(repeats):
        for key, run in runs.items():
            seconds, cpu_seconds, counts[key] = run()
            times[key].append(seconds)
            cpu[key].append(cpu_seconds)
    rows = []
    for (name, path), seconds in times.items():
        docs, tokens = corpora[name], counts[name, path]
        text_bytes = sum(len(d.encode("utf-8")) for d in docs)
        distinct, hit = cache_share(tokenizer, docs) if path == "jsonl" else (None, None)
        best, cpu_s = min(seconds), statistics.median(cpu[name, path])
        rows.append({"corpus": name, "path": path, "documents": len(docs),
                     "text_bytes": text_bytes, "tokens": tokens, "best_s": best,
                     "tokens_per_s": tokens / best, "times_s": seconds,
                     "cpu_s": cpu[name, path], "tokens_per_cpu_s": tokens / cpu_s,
                     "bytes_per_token": text_bytes / counts[name, path],
                     "distinct_pretokens": distinct, "cache_share": hit})  # fmt: skip
    return rows


def _row(r: dict, by_corpus: dict) -> str:
    c = by_corpus[r["corpus"]]
    return (
        f"| {r['corpus']} | {r['documents']:,} | {r['text_bytes'] / 1e6:.1f} | "
        f"{r['bytes_per_token']:.2f} | {c['distinct_pretokens']:,} | {c['cache_share']:.0%} | "
        f"{r['path']} | {r['tokens']:,} | {r['best_s']:.2f} | {r['tokens_per_s'] / 1e6:.2f}M | "
        f"{r['tokens_per_cpu_s'] / 1e6:.2f}M |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--corpora", default=",".join(CORPORA), help="of kjv, zipf, code")
    parser.add_argument("--megabytes", type=float, default=33.0, help="text per corpus")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/prepare_data.json"))
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        tokenizer = args.tokenizer or train_gpt2_size_bpe(work)
        trained_s = time.perf_counter() - start
        vocab = tokenizers.Tokenizer.from_file(str(tokenizer)).get_vocab_size()
        corpora = {name: CORPORA[name](args.megabytes) for name in args.corpora.split(",")}
        load = os.getloadavg()[0]
        rows = measure(corpora, tokenizer, work, args.repeats)
        encoder = interleaved(corpora, tokenizer, args.repeats)
        load = (load, os.getloadavg()[0])
    result = {
        "tokenizer": str(args.tokenizer) if args.tokenizer else "byte-level BPE trained here",
        "vocab_size": vocab, "tokenizer_training_s": None if args.tokenizer else trained_s,
        "repeats": args.repeats, "cores": os.cpu_count(), "load_average": load,
        "machine": platform.processor() or platform.machine(),
        "tokenizers_version": tokenizers.__version__, "rows": rows, "interleaved": encoder,
    }  # fmt: skip
    lines = [
        f"vocab {vocab:,}, {os.cpu_count()} cores (load average {load[0]:.1f} before, "
        f"{load[1]:.1f} after), best wall time and median CPU time of {args.repeats}",
        "",
        "| corpus | documents | MB | bytes/token | distinct pre-tokens | in the word cache "
        "| path | tokens | best s | tokens/s (best) | tokens per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        *(_row(r, {x["corpus"]: x for x in rows if x["path"] == "jsonl"}) for r in rows),
    ]  # fmt: skip
    first = encoder[0]["tokens_per_s"]
    lines += [
        "",
        "The encoder alone, corpora alternating in 1 MB batches, each batch's best of "
        f"{args.repeats}:",
        "",
        "| corpus | tokens | seconds | tokens/s | relative |",
        "|---|---:|---:|---:|---:|",
        *(f"| {r['corpus']} | {r['tokens']:,} | {r['seconds']:.2f} | "
          f"{r['tokens_per_s'] / 1e6:.2f}M | {r['tokens_per_s'] / first:.2f} |" for r in encoder),
    ]  # fmt: skip
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        intro = ["# prepare-data throughput (`bench_prepare_data.py`)", ""]
        intro += [part.replace("\n", " ") + "\n" for part in __doc__.split("\n\n")[1:3]]
        args.md.write_text("\n".join([*intro, *lines]) + "\n")


if __name__ == "__main__":
    main()
