"""Tokenizers: byte level, trained BPE, loaded tokenizer.json, id tokenizer; save/load round trips."""

import importlib.util
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_train.data import ByteTokenizer, id_tokenizer, load_tokenizer, train_bpe

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
EOS = "<|endoftext|>"
CORPUS = [
    "In the beginning was the word, and the word was with the writer.",
    "The quick brown fox jumps over the lazy dog; the dog sleeps on.",
    "Naïve café owners serve crème brûlée — déjà vu, 東京 too.",
] * 20


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_byte_round_trip_and_hf_twin_agree(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    hf = tok.to_hf()
    if EOS not in text:  # HF treats the literal separator string as the special token
        assert hf.encode(text, add_special_tokens=False).ids == ids
        assert hf.decode(ids) == text


def test_byte_vocab_with_and_without_separator():
    assert (ByteTokenizer().vocab_size, ByteTokenizer().eos_id) == (257, 256)
    assert (ByteTokenizer("").vocab_size, ByteTokenizer("").eos_id) == (256, None)


def test_byte_encode_documents_appends_the_separator():
    tokens = ByteTokenizer().encode_documents(["ab", "", "é"])
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == [97, 98, 256, 256, 195, 169, 256]
    assert ByteTokenizer().decode(tokens) == f"ab{EOS}{EOS}é{EOS}"
    assert ByteTokenizer("").encode_documents(["ab", "c"]).tolist() == [97, 98, 99]


def test_byte_decode_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"ids must be in \[0, 257\), got \[300\]"):
        ByteTokenizer().decode([65, 300])


def test_byte_save_and_load_give_the_same_ids(tmp_path):
    written = ByteTokenizer().save(tmp_path)
    assert sorted(p.name for p in written) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == EOS
    loaded = load_tokenizer(tmp_path, EOS)
    text = "Grüße, world"
    assert loaded.encode(text) == ByteTokenizer().encode(text)
    assert (loaded.vocab_size, loaded.eos_id) == (257, 256)


def test_bpe_is_deterministic_and_round_trips(tmp_path):
    first = train_bpe(CORPUS, 300, EOS)
    second = train_bpe(CORPUS, 300, EOS)
    assert first.hf.to_str() == second.hf.to_str()
    assert first.vocab_size == 300 and first.eos_id is not None
    text = "the quick word, déjà vu"
    ids = first.encode(text)
    assert len(ids) < len(text.encode("utf-8")), "merges must shorten the byte sequence"
    assert first.decode(ids) == text
    first.save(tmp_path)
    loaded = load_tokenizer(tmp_path / "tokenizer.json", EOS)
    assert loaded.encode(text) == ids
    joined = first.encode_documents(["the word", "the dog"])
    assert joined[-1] == first.eos_id and joined.tolist().count(first.eos_id) == 2


def test_bpe_without_separator():
    tok = train_bpe(CORPUS, 280, "")
    assert tok.eos_id is None and tok.hf.token_to_id(EOS) is None


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data\.tokenizer_path: no tokenizer file at"):
        load_tokenizer(tmp_path, EOS)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .* as tokenizer\.json"):
        load_tokenizer(tmp_path, EOS)
    ByteTokenizer().save(tmp_path)
    with pytest.raises(
        ValueError, match=r"data\.eos_token '</s>' is not in the tokenizer's vocabulary"
    ):
        load_tokenizer(tmp_path, "</s>")


def test_id_tokenizer():
    tok = id_tokenizer(10)
    assert tok.vocab_size == 10 and tok.eos_id is None
    assert tok.encode("t3 t9 t0") == [3, 9, 0]
    assert tok.decode([3, 9]) == "t3 t9"
    with pytest.raises(ValueError, match=r"cannot encode 'hello'"):
        tok.encode("hello")
    with pytest.raises(ValueError, match=r"ids must be in \[0, 10\), got \[10\]"):
        tok.decode([10])


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_transformers_auto_tokenizer_loads_the_saved_files(tmp_path):
    from transformers import AutoTokenizer

    bpe = train_bpe(CORPUS, 300, EOS)
    for name, tok in (("byte", ByteTokenizer()), ("bpe", bpe)):
        tok.save(tmp_path / name)
        auto = AutoTokenizer.from_pretrained(str(tmp_path / name))
        text = "the quick café"
        assert auto(text)["input_ids"] == tok.encode(text)
        assert auto.eos_token == EOS and auto.eos_token_id == tok.eos_id
