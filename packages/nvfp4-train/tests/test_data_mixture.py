"""data.mixture: realised proportions, exact resume across sources, processes, bounded memory."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tokenizers

from nvfp4_train.data import (
    ByteTokenizer,
    DataConfig,
    MixtureSource,
    make_datasets,
    prepare_corpus,
    prepared,
    train_bpe,
)
from nvfp4_train.data.mixture import round_robin
from nvfp4_train.data.tokenization import TOKENIZER_FILE
from nvfp4_train.errors import DataError

WEIGHTS = (0.5, 0.3, 0.2)
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three token files of different sizes; source k holds ids in [100k, 100k + 100)."""
    root = tmp_path_factory.mktemp("mix")
    paths = []
    for k, size in enumerate((12000, 20000, 4000)):
        np.save(root / f"s{k}.npy", (np.arange(size) % 100 + 100 * k).astype(np.uint16))
        paths.append(str(root / f"s{k}.npy"))
    return paths


def _config(paths, weights=WEIGHTS, **fields):
    mixture = tuple(MixtureSource(p, w) for p, w in zip(paths, weights, strict=True))
    fields = {
        "tokens_vocab_size": 300,
        "validation_fraction": 0.1,
        "validation_batches": 2,
        **fields,
    }
    return DataConfig(source="tokens", mixture=mixture, **fields)


def _sources_of(batch):
    return batch["inputs"][:, 0] // 100


def test_every_window_holds_each_source_share(sources):
    datasets = make_datasets(_config(sources), seq_len=8, batch_size=100, seed=1)
    it = datasets.train_iterator()
    counts = np.zeros(3)
    for _ in range(100):  # 10k sequences; the smallest source (449 sequences) repeats ~4 times
        batch = next(it)
        per_batch = np.bincount(_sources_of(batch), minlength=3)
        assert np.all(np.abs(per_batch - 100 * np.array(WEIGHTS)) <= 1), per_batch
        counts += per_batch
        assert all(np.all(batch["inputs"][_sources_of(batch) == k] // 100 == k) for k in range(3))
    np.testing.assert_allclose(counts / counts.sum(), WEIGHTS, atol=0.01)
    validation = datasets.validation_batches()
    assert [np.bincount(_sources_of(b), minlength=3).tolist() for b in validation] == [
        [50, 30, 20]
    ] * 2


def test_resume_is_exact_across_sources(sources):
    datasets = make_datasets(_config(sources), seq_len=8, batch_size=16, seed=2)
    it = datasets.train_iterator()
    for _ in range(40):  # past the first epoch of the smallest source
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(5)]
    resumed = make_datasets(_config(sources), seq_len=8, batch_size=16, seed=2).train_iterator()
    resumed.set_state(state)
    for batch in expected:
        again = next(resumed)
        assert all(np.array_equal(batch[k], again[k]) for k in batch)


def test_processes_read_their_rows_of_one_global_stream(sources):
    whole = make_datasets(_config(sources), seq_len=8, batch_size=12, seed=3).train_iterator()
    parts = [
        make_datasets(_config(sources), seq_len=8, batch_size=12, seed=3, process_index=p,
                      process_count=3).train_iterator()
        for p in range(3)
    ]  # fmt: skip
    for _ in range(3):
        joined = np.concatenate([next(part)["inputs"] for part in parts])
        np.testing.assert_array_equal(joined, next(whole)["inputs"])


def test_each_epoch_of_a_source_is_a_new_order_of_all_its_sequences(sources):
    datasets = make_datasets(_config(sources), seq_len=8, batch_size=1, seed=4)
    mixed = datasets.train_sequences
    small = [mixed.source_of(g) for g in range(5000)]
    picked = [i for k, i in small if k == 2]
    length = (4000 - 400 - 1) // 8  # the training part of source 2, in sequences
    first, second = picked[:length], picked[length : 2 * length]
    assert sorted(first) == sorted(second) == list(range(length)) and first != second


def test_round_robin_matches_weights_in_every_prefix():
    schedule = round_robin([3, 1, 1, 5], period=1000)
    counts = np.cumsum(schedule[:, None] == np.arange(4), axis=0)
    ideal = np.arange(1, 1001)[:, None] * np.array([0.3, 0.1, 0.1, 0.5])
    assert np.abs(counts - ideal).max() < 1


def test_sources_tokenized_differently_are_refused(tmp_path):
    docs = [f"document {i} of the mixture test" for i in range(200)]
    (tmp_path / "docs.txt").write_text("\n".join(docs))
    ByteTokenizer(EOS).save(tmp_path / "bytes")
    train_bpe(docs, 300, EOS).save(tmp_path / "bpe")
    for name in ("bytes", "bpe"):
        prepare_corpus(
            [tmp_path / "docs.txt"], tokenizer=tmp_path / name, output=tmp_path / f"c-{name}"
        )
    mixture = (MixtureSource(str(tmp_path / "c-bytes")), MixtureSource(str(tmp_path / "c-bpe")))
    with pytest.raises(DataError, match=r"c-bpe' has another tokenizer or vocabulary than"):
        make_datasets(DataConfig(source="tokens", mixture=mixture), seq_len=8, batch_size=2, seed=0)


def test_a_source_shorter_than_one_sequence_is_named(sources):
    cfg = _config(sources, validation_batches=0, validation_fraction=0.0)
    with pytest.raises(DataError, match=r"s2\.npy' has 4000 training tokens, fewer than one"):
        make_datasets(cfg, seq_len=4096, batch_size=1, seed=0)


MEMORY_PROBE = """
import json, sys
import grain
import numpy as np
from nvfp4_train.data import DataConfig, make_datasets

def anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

cfg = DataConfig(source="tokens", path=sys.argv[1], tokens_dtype="uint16",
                 tokens_vocab_size=4096, validation_fraction=0.0, validation_batches=0,
                 eos_token="<eos>" if "prepared" in sys.argv[1] else "")
grain.DataLoader  # imported before measuring
base = anon_mib()  # before the corpus is opened: an eager reader would show here
datasets = make_datasets(cfg, seq_len=4096, batch_size=16, seed=0)
it = datasets.train_iterator()
steps = len(datasets.train_sequences) // 16
checksum = 0
for _ in range(steps):  # every sequence of the corpus once
    checksum += int(next(it)["inputs"][:, 0].sum())
print(json.dumps({"steps": steps, "base": base, "grown": anon_mib() - base, "checksum": checksum}))
"""


VOCAB = 4096


def _write_prepared(root, shards):
    """A prepared corpus as prepare-data writes it (the files and the manifest), made directly:
    tokenizing 64M tokens would take a minute, and this test is about reading."""
    root.mkdir()
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab))
    hf.save(str(root / TOKENIZER_FILE))
    entries = []
    for index, ids in enumerate(shards):
        ids.astype("<u2").tofile(root / prepared.shard_name(index))
        digest = prepared.file_sha256(root / prepared.shard_name(index))
        entries.append({"file": prepared.shard_name(index), "tokens": int(ids.size),
                        "documents": int((ids == VOCAB - 1).sum()), "sha256": digest})  # fmt: skip
    tokenizer = {"sha256": prepared.file_sha256(root / TOKENIZER_FILE),
                 "vocab_size": VOCAB, "eos_token": "<eos>"}  # fmt: skip
    manifest = {"format": prepared.FORMAT, "version": prepared.VERSION, "tokenizer": tokenizer,
                "dtype": "uint16", "shards": entries, "sources": [],
                "documents": sum(e["documents"] for e in entries),
                "tokens": sum(e["tokens"] for e in entries)}  # fmt: skip
    prepared.write_json_atomically(root / prepared.MANIFEST, manifest)


@pytest.mark.parametrize("kind", ["prepared", "array_record"])
def test_reading_a_corpus_4x_the_memory_limit_stays_under_it(tmp_path, kind):
    """A 128 MiB corpus read whole (shuffled) grows anonymous memory by < 32 MiB."""
    limit_mib, tokens = 32, 64 * 2**20
    ids = np.random.default_rng(0).integers(0, VOCAB, size=tokens, dtype=np.uint16)
    if kind == "array_record":
        from array_record.python.array_record_module import ArrayRecordWriter

        path = tmp_path / "c.array_record"
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for record in np.split(ids, 1024):  # 1024 documents of 64k tokens
            writer.write(record.tobytes())
        writer.close()
    else:
        path = tmp_path / "prepared"
        _write_prepared(path, np.split(ids, 4))
    del ids
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEMORY_PROBE), str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["steps"] * 16 * 4096 * 2 > 4 * limit_mib * 2**20 * 0.99
    assert result["grown"] < limit_mib, result


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ((1, 1, 1e-9), r"s2\.npy' \(weight 1e-09\) has a share of 5e-10 of the training tokens, "
                       r"under one of the 16,384 slots of the schedule"),
        ((1e308, 1e308, 1), r"s2\.npy' \(weight 1\) has a share of 5e-309 of the training"),
    ],
)  # fmt: skip
def test_a_source_whose_share_rounds_to_nothing_is_refused(sources, weights, message):
    with pytest.raises(DataError, match=message):
        make_datasets(_config(sources, weights), seq_len=8, batch_size=4, seed=0)


def test_huge_weights_are_normalized_without_overflow(sources):
    with np.errstate(all="raise"):  # an overflow is an error here, not a warning
        datasets = make_datasets(_config(sources, (1e308,) * 3), seq_len=8, batch_size=3, seed=0)
    assert (
        np.bincount(_sources_of(next(datasets.train_iterator())), minlength=3).tolist() == [1] * 3
    )


def test_the_realised_shares_are_reported_and_counted_per_source(sources):
    datasets = make_datasets(_config(sources), seq_len=8, batch_size=10, seed=0)
    names = ", ".join(f"{p} {share}%" for p, share in zip(sources, (50, 30, 20), strict=True))
    assert datasets.documents.endswith(
        f"mixture of 3 sources (data.mixture), shares of training tokens: {names}"
    )
    it, rows = datasets.train_iterator(), np.zeros(3, dtype=np.int64)
    for _ in range(7):
        rows += np.bincount(_sources_of(next(it)), minlength=3)
    assert datasets.tokens_by_source(7) == dict(zip(sources, (rows * 8).tolist(), strict=True))


def test_the_builtin_corpus_is_a_mixture_source_in_the_mixture_tokenizer(sources, tmp_path):
    ByteTokenizer(EOS).save(tmp_path / "tok")
    (tmp_path / "z.txt").write_text("zz " * 20_000)
    prepare_corpus([tmp_path / "z.txt"], tokenizer=tmp_path / "tok", output=tmp_path / "z")
    mixture = (MixtureSource(str(tmp_path / "z")), MixtureSource("builtin"))
    datasets = make_datasets(DataConfig(source="tokens", mixture=mixture, validation_batches=1),
                             seq_len=256, batch_size=4, seed=0)  # fmt: skip
    rows = [datasets.tokenizer.decode(row) for row in next(datasets.train_iterator())["inputs"]]
    assert sum(set(row) <= set("z ") for row in rows) == 2  # the other two are the Bible's
    assert sum(" the " in row or " and " in row for row in rows) == 2
    without = _config([sources[0], "builtin"], (1, 1))  # token ids without a tokenizer
    with pytest.raises(DataError, match=r"'builtin' is tokenized with the mixture's tokenizer, "
                       r"but no source brings one"):  # fmt: skip
        make_datasets(without, seq_len=8, batch_size=2, seed=0)
