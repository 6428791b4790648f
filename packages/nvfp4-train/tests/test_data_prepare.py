"""prepare-data: parquet / JSONL / text to token shards, resume byte-identity, bad input, reading."""

import gzip
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from nvfp4_train.cli import main
from nvfp4_train.data import ByteTokenizer, DataConfig, make_datasets, open_prepared
from nvfp4_train.data.prepare import prepare_corpus
from nvfp4_train.data.prepared import FORMAT, MANIFEST, STATE, VERSION
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
    (tmp_path / "shard-notes.md").write_text("mine")  # not a name prepare-data writes
    _prepare(root, tmp_path)
    assert (tmp_path / "shard-notes.md").read_text() == "mine"
    (tmp_path / "shard-notes.md").unlink()
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


def _tree(root):
    """Every file under `root` with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _state(**fields):
    return json.dumps({"format": FORMAT, "version": VERSION, "sources": [],
                       "tokenizer": {}, "dtype": "uint16", "next": {}, **fields})  # fmt: skip


BAD_COMMANDS = {  # name: (files to make under tmp_path, argv after the tokenizer, error)
    "a directory of yours": (
        {"out/tokenizer.json": '{"mine": 1}', "out/shard-notes.md": "notes"}, ["in", "-o", "out"],
        r"--output 'out' holds files prepare-data did not write \(shard-notes\.md, tokenizer\.json\)",
    ),
    "output = input": (
        {}, ["in", "-o", "in"], r"input 'in' lies in --output 'in', .* \(no input left\)"
    ),
    "output = the input's directory": (
        {}, ["in/a.jsonl", "-o", "in"], r"input 'in/a\.jsonl' lies in --output 'in'.*no input left"
    ),
    "manifest [1,2]": (
        {"out/manifest.json": "[1,2]"}, ["in", "-o", "out"],
        r"manifest\.json is damaged or not prepare-data's \(not a nvfp4-train prepared corpus",
    ),
    "manifest {{{": (
        {"out/manifest.json": "{{{"}, ["in", "-o", "out"],
        r"'out': manifest\.json is damaged or not prepare-data's \(not JSON: Expecting",
    ),
    "state {{{": (
        {"out/prepare-state.json": "{{{"}, ["in", "-o", "out"],
        r"prepare-state\.json is damaged or not prepare-data's \(not JSON",
    ),
    "state naming a file elsewhere": (
        {"out/prepare-state.json": _state(shards=[{"file": "../in/a.jsonl", "tokens": 1,
                                                   "sha256": ""}])},  # fmt: skip
        ["in", "-o", "out"], r"a shard entry is not \{file: shard-NNNNN\.bin",
    ),
    "--shard-tokens 0": (
        {}, ["in", "-o", "out", "--shard-tokens", "0"],
        r"--shard-tokens must be a whole number >= 1, got 0",
    ),
    "a .zst input": (
        {"c.jsonl.zst": "x"}, ["c.jsonl.zst", "-o", "out"],
        r"'c\.jsonl\.zst': compressed \(\.zst\); only \.jsonl\.gz / \.json\.gz are read",
    ),
    "a directory of .zst files": (
        {"z/c.jsonl.zst": "x"}, ["z", "-o", "out"],
        r"'z': no \.parquet, .* files in this directory \(skipped: c\.jsonl\.zst: compressed",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_COMMANDS))
def test_bad_commands_are_one_line_errors_that_write_nothing(
    corpus, tmp_path, monkeypatch, capsys, name
):
    files, argv, message = BAD_COMMANDS[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "one document"}\n')
    for file, text in files.items():
        (tmp_path / file).parent.mkdir(exist_ok=True)
        (tmp_path / file).write_text(text)
    before = _tree(tmp_path)
    assert main(["prepare-data", "--tokenizer", str(corpus[0] / "tok"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert _tree(tmp_path) == before


def test_an_edited_input_is_noticed_on_a_rerun_and_on_a_resume(corpus, tmp_path):
    tok = corpus[0] / "tok"
    text = tmp_path / "a.jsonl"
    text.write_text("".join(f'{{"text": "the quick brown fox {i}"}}\n' for i in range(50)))
    prepare_corpus([text], tokenizer=tok, output=tmp_path / "done")
    text.write_text(text.read_text().replace("quick", "QUICK"))  # sed -i s/quick/QUICK/g
    with pytest.raises(DataError, match=r"a\.jsonl' changed since the corpus in .*done' was "
                       r"prepared \(its SHA-256 differs\); prepare it into a new --output"):  # fmt: skip
        prepare_corpus([text], tokenizer=tok, output=tmp_path / "done")

    def interrupt(progress):
        if progress.shards:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([text], tokenizer=tok, output=tmp_path / "part", shard_tokens=100,
                       report=interrupt)  # fmt: skip
    stat = text.stat()
    text.write_text(text.read_text().replace("QUICK", "quack"))  # the same size
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    with pytest.raises(DataError, match=r"a\.jsonl' changed since the interrupted preparation"):
        prepare_corpus([text], tokenizer=tok, output=tmp_path / "part", shard_tokens=100)


def test_an_input_named_twice_is_read_once(corpus, tmp_path):
    (tmp_path / "in").mkdir()
    a, b = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "b.jsonl"
    a.write_text('{"text": "alpha"}\n')
    b.write_text('{"text": "beta"}\n')
    for k, inputs in enumerate(([a, a], [tmp_path / "in", a])):
        manifest = prepare_corpus(inputs, tokenizer=corpus[0] / "tok", output=tmp_path / f"o{k}")
        assert manifest["documents"] == len(manifest["sources"]) == k + 1
        assert manifest["skipped"] == [{"path": str(a), "reason": f"already an input (as {a})"}]


@pytest.mark.parametrize("damage", ["delete", "overwrite"])
def test_a_damaged_shard_stops_a_rerun_and_a_resume(corpus, tmp_path, damage):
    root, _ = corpus

    def spoil(shard):
        if damage == "delete":
            shard.unlink()
        else:  # the same size, other ids
            shard.write_bytes(shard.read_bytes()[::-1])

    manifest = _prepare(root, tmp_path / "done")
    spoil(tmp_path / "done" / manifest["shards"][1]["file"])
    with pytest.raises(DataError, match=r"the prepared corpus .*done' is damaged: shard .*"
                       r"shard-00001\.bin"):  # fmt: skip
        _prepare(root, tmp_path / "done")

    def interrupt(progress):
        if progress.shards >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _prepare(root, tmp_path / "part", report=interrupt)
    spoil(tmp_path / "part" / "shard-00000.bin")
    with pytest.raises(DataError, match=r"cannot resume .* shard .*shard-00000\.bin"):
        _prepare(root, tmp_path / "part")


def test_a_separator_written_in_the_text_stays_text(tmp_path):
    ByteTokenizer("<EOT>").save(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_text('{"text": "a <EOT> b"}\n{"text": "<EOT>"}\n')
    out = tmp_path / "out"
    manifest = prepare_corpus([tmp_path / "a.jsonl"], tokenizer=tmp_path / "tok", output=out,
                              eos_token="<EOT>")  # fmt: skip
    ids = np.fromfile(out / "shard-00000.bin", dtype="<u2")
    assert np.flatnonzero(ids == 256).tolist() == [9, 15]  # after "a <EOT> b" and "<EOT>"
    assert manifest["documents"] == 2 and manifest["literal_separators"] == 2
    assert manifest["sources"][0]["literal_separators"] == 2


def test_directory_inputs_skip_hidden_and_foreign_files_and_list_them(corpus, tmp_path, capsys):
    root = tmp_path / "in"
    for name in ("a.jsonl", ".hidden.jsonl", ".git/x.jsonl", "sub/b.jsonl", "LICENSE.txt",
                 "README.md", "x.csv", "c.jsonl.zst"):  # fmt: skip
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f'{{"text": "{name}"}}\n')
    out = tmp_path / "out"
    assert main(["prepare-data", str(root), "--tokenizer", str(corpus[0] / "tok"),
                 "-o", str(out)]) == 0  # fmt: skip
    manifest = json.loads((out / MANIFEST).read_text())
    assert [s["path"] for s in manifest["sources"]] == [
        str(root / "a.jsonl"),
        str(root / "sub/b.jsonl"),
    ]
    reasons = {e["path"].removeprefix(f"{root}/"): e["reason"] for e in manifest["skipped"]}
    assert (
        list(reasons)
        == sorted(reasons)
        == [".git", ".hidden.jsonl", "LICENSE.txt", "README.md", "c.jsonl.zst", "x.csv"]
    )
    assert reasons[".git"] == "hidden directory" and reasons[".hidden.jsonl"] == "hidden"
    assert reasons["LICENSE.txt"].startswith("a licence / readme file")
    assert reasons["README.md"].startswith("not a corpus file (.md)")
    assert reasons["c.jsonl.zst"].startswith("compressed (.zst)")
    printed = capsys.readouterr().out
    assert "took 2 file(s):" in printed and "skipped 6:" in printed
    assert f"{root}/x.csv: not a corpus file (.csv)" in printed
    named = prepare_corpus(
        [root / "LICENSE.txt"], tokenizer=corpus[0] / "tok", output=tmp_path / "l"
    )
    assert named["documents"] == 1  # named, a licence file is taken


def test_a_dictionary_encoded_parquet_column_is_read_as_text(corpus, tmp_path):
    texts = pa.array(["a b", "c d", "a b", None]).dictionary_encode()  # a pandas categorical
    pq.write_table(pa.table({"text": texts}), tmp_path / "cat.parquet")
    out = tmp_path / "out"
    manifest = prepare_corpus([tmp_path / "cat.parquet"], tokenizer=corpus[0] / "tok", output=out)
    assert manifest["documents"] == 3
    assert ByteTokenizer(EOS).decode(open_prepared(out).stream[:]) == f"a b{EOS}c d{EOS}a b{EOS}"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_resumed_preparation_reports_from_where_it_starts_to_the_end(corpus, tmp_path, kind):
    texts = [f"record {i} " * (1 + i % 7) for i in range(2500)]  # 3 batches of records
    file = tmp_path / f"c.{kind}"
    if kind == "jsonl":
        file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    else:
        pq.write_table(pa.table({"text": texts}), file, row_group_size=500)
    run = {"inputs": [file], "tokenizer": corpus[0] / "tok", "output": tmp_path / "out",
           "shard_tokens": 20_000}  # fmt: skip

    def interrupt(progress):
        if progress.shards >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(**run, report=interrupt)
    before = json.loads((tmp_path / "out" / STATE).read_text())
    assert 0 < before["next"]["record"] < 1024  # inside the first batch of records
    seen = []
    manifest = prepare_corpus(**run, report=seen.append)
    assert seen[0].tokens == before["tokens"] and seen[0].shards == 2  # where this run starts
    assert seen[0].bytes_done > 0  # the records read before count as read
    assert all(a.bytes_done <= b.bytes_done for a, b in itertools.pairwise(seen))
    assert seen[-1].bytes_done == seen[-1].bytes_total == file.stat().st_size
    assert seen[-1].tokens == manifest["tokens"]


def test_the_summary_counts_the_tokens_of_this_run(corpus, tmp_path, capsys):
    root, _ = corpus
    out = tmp_path / "out"

    def interrupt(progress):
        if progress.shards >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _prepare(root, out, report=interrupt)
    before = json.loads((out / STATE).read_text())["tokens"]
    inputs = [str(root / name) for name in ("a.jsonl.gz", "b.parquet", "c.txt")]
    assert main(["prepare-data", *inputs, "--tokenizer", str(root / "tok"), "-o", str(out),
                 "--shard-tokens", "1500"]) == 0  # fmt: skip
    total = json.loads((out / MANIFEST).read_text())["tokens"]
    printed = capsys.readouterr().out
    assert f"this run: {total - before:,} tokens, " in printed
    assert f"(resumed: {before:,} tokens were prepared before)" in printed


def test_a_failed_preparation_does_not_block_the_corrected_command(corpus, tmp_path):
    root, _ = corpus
    good, tok, out = root / "a.jsonl.gz", root / "tok", tmp_path / "out"
    with pytest.raises(DataError, match=r"line 1 has no field 'body'"):
        prepare_corpus([good], tokenizer=tok, output=out, text_field="body")
    assert not out.exists()  # nothing written: it removed its files and the directory it made
    (tmp_path / "empty.jsonl").write_text("")
    broken = [good, tmp_path / "empty.jsonl"]  # shards of a.jsonl.gz are written before the error
    for _ in range(2):  # the same command: the same error, the shards kept for it
        with pytest.raises(DataError, match=r"empty\.jsonl' holds no documents .*shard\(s\) kept"):
            prepare_corpus(broken, tokenizer=tok, output=out, shard_tokens=500)
    manifest = prepare_corpus([good], tokenizer=tok, output=out, shard_tokens=500)  # corrected
    assert manifest["documents"] == 60 and not (out / STATE).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST, "tokenizer.json", *(s["file"] for s in manifest["shards"])]
    )


MEMORY_PROBE = """
import json, sys
from pathlib import Path
from nvfp4_train.data import prepare_corpus

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])

root = Path(sys.argv[1])
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = kib("VmRSS:")
manifest = prepare_corpus([root / "doc.jsonl"], tokenizer=root / "tokenizer.json",
                          output=root / "out", eos_token="<eos>")
print(json.dumps({"tokens": manifest["tokens"], "grown_mib": (kib("VmHWM:") - base) / 1024}))
"""


def test_a_20_mb_document_is_prepared_in_bounded_memory(tmp_path):
    """One 20 MiB document: the encoder works on chunks, so the process's peak grows by a few
    hundred MiB (measured ~270), not by the ~2.7 GiB (~137 bytes a character) that encoding it
    whole costs."""
    words = [f"w{i}" for i in range(1000)]
    vocab = {w: i for i, w in enumerate(words)} | {"[UNK]": 1000, "<eos>": 1001}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()  # fast: the test is memory
    hf.add_special_tokens(["<eos>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(words, size=20 * 2**20 // 5).tolist())
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    del text
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEMORY_PROBE), str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["tokens"] == 20 * 2**20 // 5 + 1
    assert result["grown_mib"] < 400, result
