"""Packing into sequences of seq_len + 1 tokens, the held-out split, id checks, pickling."""

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvfp4_train.data.packing import PackedSequences, check_token_ids, split_documents, split_range


def test_sequences_are_shifted_windows_that_cover_the_stream():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 500, size=1003).astype(np.uint16)
    source = PackedSequences(tokens, 0, tokens.size, seq_len=10, vocab_size=500)
    assert len(source) == (1003 - 1) // 10
    targets = []
    for i in range(len(source)):
        item = source[i]
        assert item["inputs"].dtype == np.int32 and item["inputs"].shape == (10,)
        np.testing.assert_array_equal(item["inputs"], tokens[i * 10 : i * 10 + 10])
        np.testing.assert_array_equal(item["targets"][:-1], item["inputs"][1:])
        targets.append(item["targets"])
    np.testing.assert_array_equal(np.concatenate(targets), tokens[1 : 1 + 10 * len(source)])


def test_a_range_inside_a_shared_array():
    tokens = np.arange(100, dtype=np.uint32)
    source = PackedSequences(tokens, 50, 100, seq_len=7, vocab_size=100)
    assert len(source) == 7
    assert source[0]["inputs"][0] == 50 and source[6]["targets"][-1] == 99
    with pytest.raises(IndexError, match=r"sequence index 7 out of range \[0, 7\)"):
        source[7]


def test_too_short_range_has_no_sequences():
    assert len(PackedSequences(np.arange(8), 0, 8, seq_len=7, vocab_size=8)) == 1
    assert len(PackedSequences(np.arange(7), 0, 7, seq_len=7, vocab_size=8)) == 0


def test_out_of_vocabulary_id_fails_when_read():
    tokens = np.array([1, 2, 3, 900, 4, 5, 6, 7, 8], dtype=np.uint16)
    source = PackedSequences(tokens, 0, tokens.size, seq_len=4, vocab_size=10)
    with pytest.raises(ValueError, match=r"holds token id 900, outside the vocabulary \[0, 10\)"):
        source[0]
    assert source[1]["inputs"].tolist() == [4, 5, 6, 7]


def test_check_token_ids_catches_negative_and_too_large():
    check_token_ids(np.array([0, 9]), 10, "x")
    with pytest.raises(ValueError, match=r"x holds token id -1"):
        check_token_ids(np.array([3, -1]), 10, "x")
    with pytest.raises(ValueError, match=r"x holds token id 10, outside"):
        check_token_ids(np.array([10]), 10, "x")


def test_repr_identifies_the_content():
    a = PackedSequences(np.arange(100), 0, 100, seq_len=8, vocab_size=100)
    b = PackedSequences(np.arange(100)[::-1].copy(), 0, 100, seq_len=8, vocab_size=100)
    assert repr(a) != repr(b)
    assert repr(a) == repr(PackedSequences(np.arange(100), 0, 100, seq_len=8, vocab_size=100))


def test_memmap_source_pickles_by_file_name(tmp_path):
    ids = np.arange(5000, dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    tokens = np.load(tmp_path / "ids.npy", mmap_mode="r")
    source = PackedSequences(tokens, 1000, 5000, seq_len=16, vocab_size=5000)
    blob = pickle.dumps(source)
    assert len(blob) < 2000, "the token array must not be copied into the pickle"
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone[3]["inputs"], source[3]["inputs"])
    assert repr(clone) == repr(source)


@given(
    st.lists(st.text(alphabet="ab\n ", min_size=0, max_size=40), min_size=1, max_size=12),
    st.floats(0.0, 0.5),
)
def test_document_split_is_disjoint_and_complete(documents, fraction):
    train, held = split_documents(documents, fraction)
    assert "".join(train) + "".join(held) == "".join(documents)
    target = round(sum(map(len, documents)) * fraction)
    assert target <= sum(map(len, held)) <= 2 * target


def test_document_split_cuts_at_a_line_break():
    train, held = split_documents(["one\ntwo\nthree four"], 0.4)  # hold out 7 characters
    assert (train, held) == (["one\ntwo\n"], ["three four"])
    train, held = split_documents(["one\ntwo\nthree four"], 0.1)  # 2: no line break near
    assert (train, held) == (["one\ntwo\nthree fo"], ["ur"])


def test_token_split_takes_the_end():
    assert split_range(1000, 0.02) == ((0, 980), (980, 1000))
    assert split_range(10, 0.0) == ((0, 10), (10, 10))
