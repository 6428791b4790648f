"""Tokenizers: byte level, trained BPE, loaded tokenizer.json, id tokenizer; save/load round trips."""

import importlib.util
import json

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, pre_tokenizers, trainers

from nvfp4_train.data import ByteTokenizer, HFTokenizer, id_tokenizer, load_tokenizer, train_bpe
from nvfp4_train.data.tokenization import encode_joined, text_chunks

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


def _metaspace_bpe():
    hf = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()  # SentencePiece style: "▁word"
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", EOS], show_progress=False
    )
    hf.train_from_iterator(CORPUS, trainer=trainer)
    return HFTokenizer(hf, EOS)


TOKENIZERS = {
    "byte-level BPE (GPT-2 pre-tokenizer)": lambda: train_bpe(CORPUS, 400, EOS),
    "Metaspace BPE": _metaspace_bpe,
    "bytes (tokenizer.json twin)": lambda: HFTokenizer(ByteTokenizer(EOS).to_hf(), EOS),
}


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_long_documents_are_encoded_in_chunks_with_the_ids_of_the_whole(name):
    tok = TOKENIZERS[name]()
    rng = np.random.default_rng(0)
    words = [
        "the",
        "word",
        "",
        "was\twith",
        "déjà-vu,",
        "東京",
        "and\nthe",
        "dog's",
        "123",
        "(sleep)",
        "\n\n",
        "",
        "ok",
    ]
    text = " ".join(rng.choice(words, size=3000))  # ~15k characters, odd spaces included
    chunks = text_chunks(text, 512)
    assert "".join(chunks) == text and len(chunks) > 25
    assert all(c[0] == " " and not c[1].isspace() for c in chunks[1:])  # cut before " word"
    whole = tok.hf.encode(text, add_special_tokens=False).ids + [tok.eos_id]
    flat, ends = encode_joined(tok.hf, [text, "x"], tok.eos_id, np.uint32, chunk_chars=512,
                               batch_chars=2048)  # fmt: skip
    assert flat[: ends[0]].tolist() == whole and ends.tolist() == [len(whole), flat.size]


def test_text_without_spaces_is_cut_at_the_chunk_size():
    assert text_chunks("東京" * 700, 512) == ["東京" * 256, "東京" * 256, "東京" * 188]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_separator_written_in_a_document_is_encoded_as_text(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode_documents([f"the word {EOS} the dog", EOS]).tolist()
    assert ids.count(tok.eos_id) == 2 and ids[-1] == tok.eos_id
    assert tok.hf.encode_special_tokens is False  # the tokenizer is left as it was


def test_a_separator_that_is_an_ordinary_token_is_refused():
    vocab = {"a": 0, "<eos>": 1}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "<eos>" is a word of it, not special
    with pytest.raises(ValueError, match=r"encodes to the separator id 1: .* an ordinary"):
        encode_joined(hf, ["a <eos> a"], 1, np.uint16)
