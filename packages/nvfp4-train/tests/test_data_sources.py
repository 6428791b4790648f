"""Corpus readers: the built-in KJV text, text files, .npy/.bin/ArrayRecord token files, synthetic."""

import importlib.util
import pickle
import re

import numpy as np
import pytest

from nvfp4_train.data.builtin_text import KJV_ROWS, kjv_chapters, kjv_verses
from nvfp4_train.data.sources import (
    SYNTHETIC_STEPS,
    read_documents,
    synthetic_stream,
    text_files,
    token_array,
)
from nvfp4_train.errors import DataError

HAS_ARRAY_RECORD = importlib.util.find_spec("array_record") is not None


def test_kjv_rows_and_chapters():
    rows = kjv_verses()
    assert len(rows) == KJV_ROWS == 24_408
    assert sum(len(text) for _, text in rows) == 4_267_894  # the raw passages, references included
    chapters = kjv_chapters()
    assert len(chapters) == 1_189
    assert chapters[0].startswith("In the beginning God created")
    assert chapters[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    text = "\n".join(chapters)
    assert not re.search(r"\d", text), "verse references must be stripped"
    assert 4_000_000 < len(text) < 4_300_000
    assert text.count("\n") + 1 > 31_000  # one verse per line


def test_text_file_directory_and_glob(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third", encoding="utf-8")
    assert read_documents(text_files(str(tmp_path), "*.txt")) == ["first", "second"]
    assert read_documents(text_files(str(tmp_path), "**/*.txt")) == ["first", "second", "third"]
    assert read_documents(text_files(str(tmp_path / "b.txt"), "*.txt")) == ["second"]


def test_text_errors(tmp_path):
    # DataError: the CLI's one-line user error; still a ValueError for API callers
    with pytest.raises(DataError, match=r"data\.path: '.*nowhere' does not exist"):
        text_files(str(tmp_path / "nowhere"), "*.txt")
    assert issubclass(DataError, ValueError)
    with pytest.raises(DataError, match=r"no files match data\.text_glob='\*\.txt'"):
        text_files(str(tmp_path), "*.txt")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"the corpus is empty \(1 file\(s\), all empty\)"):
        read_documents(text_files(str(tmp_path), "*.txt"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt' is not UTF-8 text"):
        read_documents([tmp_path / "latin1.txt"])


def test_npy_is_memory_mapped_and_flattened(tmp_path):
    ids = np.arange(24, dtype=np.uint16).reshape(4, 6)
    np.save(tmp_path / "ids.npy", ids)
    tokens = token_array(str(tmp_path / "ids.npy"), "uint16", eos_id=None)
    assert isinstance(tokens, np.memmap)
    np.testing.assert_array_equal(tokens, ids.reshape(-1))


def test_npy_of_floats_is_rejected(tmp_path):
    np.save(tmp_path / "f.npy", np.ones(8, dtype=np.float32))
    with pytest.raises(
        ValueError, match=r"holds float32 values; token ids must be an integer dtype"
    ):
        token_array(str(tmp_path / "f.npy"), "uint16", eos_id=None)


def test_npy_with_objects_is_not_unpickled(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"cannot memory-map .*o\.npy"):
        token_array(str(tmp_path / "o.npy"), "uint16", eos_id=None)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 60_000, size=100).astype(dtype)
    ids.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp_path / "ids.bin")
    tokens = token_array(str(tmp_path / "ids.bin"), dtype, eos_id=None)
    np.testing.assert_array_equal(tokens, ids)


def test_bin_with_the_wrong_dtype(tmp_path):
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "odd.bin")  # 10 bytes: not uint32
    with pytest.raises(
        ValueError, match=r"has 10 bytes, not a multiple of 4: is data\.tokens_dtype='uint32'"
    ):
        token_array(str(tmp_path / "odd.bin"), "uint32", eos_id=None)


def test_unknown_token_file_kind(tmp_path):
    (tmp_path / "ids.csv").write_text("1,2,3")
    with pytest.raises(ValueError, match=r"is not a token file; expected one of \.npy, \.bin"):
        token_array(str(tmp_path / "ids.csv"), "uint16", eos_id=None)


def _write_array_record(path, records):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record.tobytes())
    writer.close()


@pytest.mark.skipif(not HAS_ARRAY_RECORD, reason="array_record is not installed")
def test_array_record_documents_joined_with_eos(tmp_path):
    documents = [np.array([5, 6, 7], dtype="<u4"), np.array([8], dtype="<u4")]
    _write_array_record(tmp_path / "part-0.array_record", documents)
    tokens = token_array(str(tmp_path / "part-0.array_record"), "uint32", eos_id=1)
    np.testing.assert_array_equal(tokens[:], [5, 6, 7, 1, 8, 1])
    np.testing.assert_array_equal(tokens[2:5], [7, 1, 8])  # read lazily, across records
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(tokens))[1:], [6, 7, 1, 8, 1])
    from_dir = token_array(str(tmp_path), "uint32", eos_id=None)
    np.testing.assert_array_equal(from_dir[:], [5, 6, 7, 8])


@pytest.mark.skipif(not HAS_ARRAY_RECORD, reason="array_record is not installed")
def test_array_record_with_the_wrong_dtype(tmp_path):
    _write_array_record(tmp_path / "x.array_record", [np.array([1, 2, 3], dtype="<u2")])
    with pytest.raises(ValueError, match=r"record 0 has 6 bytes, not a multiple of 4"):
        token_array(str(tmp_path / "x.array_record"), "uint32", eos_id=None)


def test_synthetic_stream_is_fixed_and_learnable():
    a = synthetic_stream(vocab_size=50, num_tokens=1000)
    np.testing.assert_array_equal(a, synthetic_stream(vocab_size=50, num_tokens=1000))
    assert a.min() >= 0 and a.max() < 50
    steps = np.diff(a.astype(np.int64)) % 50
    assert set(steps.tolist()) == set(SYNTHETIC_STEPS)
