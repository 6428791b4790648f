"""prepare-data: parquet / JSONL / text to token shards, resume byte-identity, bad input, reading."""

import gzip
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nvfp4_train.cli import main
from nvfp4_train.data import ByteTokenizer, DataConfig, make_datasets, open_prepared
from nvfp4_train.data.prepare import prepare_corpus
from nvfp4_train.data.prepared import MANIFEST, STATE
from nvfp4_train.errors import DataError

EOS = "<|endoftext|>"


def _documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["in", "the", "beginning", "was", "word", "ünïcode", "日本", "and", "light", "\n"]
    return [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three inputs (JSONL.gz with a blank line, parquet with a null row, text), a tokenizer."""
    root = tmp_path_factory.mktemp("raw")
    docs = _documents(140, seed=0)
    with gzip.open(root / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        for i, doc in enumerate(docs[:60]):
            f.write(json.dumps({"id": i, "text": doc}) + "\n" + ("\n" if i == 3 else ""))
    rows = [*docs[60:139], None]
    pq.write_table(pa.table({"text": rows}), root / "b.parquet", row_group_size=16)
    (root / "c.txt").write_text(docs[139], encoding="utf-8")
    ByteTokenizer(EOS).save(root / "tok")
    return root, docs


def _prepare(root, out, **kwargs):
    inputs = [root / "a.jsonl.gz", root / "b.parquet", root / "c.txt"]
    return prepare_corpus(inputs, tokenizer=root / "tok", output=out, shard_tokens=1500, **kwargs)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    root, _ = corpus
    out = tmp_path_factory.mktemp("prepared")
    return out, _prepare(root, out)


def test_prepared_stream_is_the_documents_each_followed_by_the_separator(corpus, prepared):
    _, docs = corpus
    out, manifest = prepared
    opened = open_prepared(out)
    text = ByteTokenizer(EOS).decode(opened.stream[:])
    assert text == "".join(doc + EOS for doc in docs)
    assert (manifest["documents"], opened.documents, opened.vocab_size) == (140, 140, 257)
    assert [s["documents"] for s in manifest["sources"]] == [60, 79, 1]
    assert sum(s["tokens"] for s in manifest["sources"]) == manifest["tokens"] == opened.stream.size
    assert len(manifest["shards"]) > 3 and not (out / STATE).exists()
    for shard in manifest["shards"]:  # shards end at document ends, past shard_tokens
        ids = np.fromfile(out / shard["file"], dtype="<u2")
        assert ids[-1] == 256 and (ids == 256).sum() == shard["documents"]
        assert shard["tokens"] >= 1500 or shard is manifest["shards"][-1]


def test_an_interrupted_preparation_resumes_byte_identical(corpus, prepared, tmp_path):
    root, _ = corpus
    reference, _ = prepared

    def interrupt(progress):
        if progress.shards >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _prepare(root, tmp_path, report=interrupt)
    assert (tmp_path / STATE).is_file() and not (tmp_path / MANIFEST).exists()
    with pytest.raises(DataError, match=r"unfinished prepare-data output \(no manifest\.json\)"):
        open_prepared(tmp_path)  # never read as complete
    (tmp_path / "shard-00007.bin").write_bytes(b"half")  # a shard the state does not list
    _prepare(root, tmp_path)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in reference.iterdir())
    for name in written:
        assert (tmp_path / name).read_bytes() == (reference / name).read_bytes(), name


def test_the_training_pipeline_reads_a_prepared_corpus(prepared):
    out, manifest = prepared
    datasets = make_datasets(
        DataConfig(source="tokens", path=str(out), validation_batches=1),
        seq_len=64, batch_size=4, seed=0,
    )  # fmt: skip
    assert datasets.vocab_size == 257 and "separator id 256" in datasets.documents
    batch = next(datasets.train_iterator())
    assert batch["inputs"].shape == (4, 64) and batch["segment_ids"].max() >= 1
    with pytest.raises(DataError, match=r"prepared with separator '<\|endoftext\|>'; set"):
        make_datasets(DataConfig(source="tokens", path=str(out), eos_token="</s>"),
                      seq_len=64, batch_size=4, seed=0)  # fmt: skip


def test_a_tokenizer_that_does_not_match_the_manifest(prepared, tmp_path):
    out, _ = prepared
    ByteTokenizer("<eos>").save(tmp_path)
    cfg = DataConfig(source="tokens", path=str(out), tokenizer_path=str(tmp_path))
    with pytest.raises(DataError, match=r"is not the tokenizer .* was prepared with"):
        make_datasets(cfg, seq_len=64, batch_size=4, seed=0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_shard_is_named(prepared, tmp_path, damage):
    out, manifest = prepared
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in out.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    shard = copy / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    if damage == "delete":
        shard.unlink()
    else:
        data[5] ^= 1
        shard.write_bytes(data if damage == "flip" else data[:-2])
    with pytest.raises(DataError, match=re.escape(repr(str(shard)))):
        open_prepared(copy)


def test_bad_inputs_are_one_line_errors_naming_the_file(corpus, tmp_path):
    root, _ = corpus
    tok = root / "tok"
    cases = []
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "nocol.parquet")
    cases.append(
        (tmp_path / "nocol.parquet", r"nocol\.parquet': no column 'text' \(columns: content\)")
    )
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    cases.append((tmp_path / "bad.jsonl", r"bad\.jsonl': line 2 has no field 'text'"))
    (tmp_path / "empty.jsonl").write_text("")
    cases.append((tmp_path / "empty.jsonl", r"empty\.jsonl' holds no documents"))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-20])
    cases.append((tmp_path / "cut.jsonl.gz", r"cut\.jsonl\.gz' is damaged: EOFError"))
    (tmp_path / "x.csv").write_text("a")
    cases.append((tmp_path / "x.csv", r"x\.csv': not a corpus file"))
    for i, (file, message) in enumerate(cases):
        with pytest.raises(DataError, match=message):
            prepare_corpus([file], tokenizer=tok, output=tmp_path / f"out{i}")
    with pytest.raises(DataError, match=r"--eos-token '</s>' is not in the vocabulary"):
        prepare_corpus([root / "c.txt"], tokenizer=tok, output=tmp_path / "o", eos_token="</s>")


def test_an_output_inside_the_input_directory_is_not_read_back(tmp_path, corpus):
    root, _ = corpus
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "one document"}\n')
    out = tmp_path / "in" / "prepared"

    def interrupt(progress):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # leaves prepare-state.json (a .json) in the input tree
        prepare_corpus([tmp_path / "in"], tokenizer=root / "tok", output=out, report=interrupt)
    manifest = prepare_corpus([tmp_path / "in"], tokenizer=root / "tok", output=out)
    assert [s["path"] for s in manifest["sources"]] == [str(tmp_path / "in" / "a.jsonl")]
    assert manifest["documents"] == 1


def test_rerun_with_other_arguments_is_refused(corpus, prepared, tmp_path):
    root, _ = corpus
    out, manifest = prepared
    assert _prepare(root, out) == manifest  # finished: nothing to do
    with pytest.raises(DataError, match=r"already holds a prepared corpus made with other"):
        prepare_corpus([root / "c.txt"], tokenizer=root / "tok", output=out)


def test_the_command_line(corpus, tmp_path, capsys):
    root, _ = corpus
    args = ["prepare-data", str(root / "c.txt"), "--tokenizer", str(root / "tok")]
    assert main([*args, "-o", str(tmp_path / "ok")]) == 0
    assert re.search(r"1 documents, 1 shard\(s\) from 1 file\(s\)", capsys.readouterr().out)
    assert main([*args, "-o", str(tmp_path / "bad"), "--eos-token", "</s>"]) == 2
    assert capsys.readouterr().err.startswith("error: --eos-token '</s>' is not in the vocabulary")
