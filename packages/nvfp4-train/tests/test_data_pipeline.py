"""make_datasets: batches, determinism, epochs, resume from state, sharding, validation, errors."""

import itertools

import numpy as np
import pytest

from nvfp4_train.data import ByteTokenizer, DataConfig, MixtureSource, make_datasets, train_bpe
from nvfp4_train.data.builtin_text import kjv_chapters
from nvfp4_train.data.iterator_state import restore_iterator_state
from nvfp4_train.data.packing import split_documents
from nvfp4_train.errors import DataError

SEQ_LEN = 8
NUM_TOKENS = 2000  # 1960 training tokens -> 244 sequences of 9 tokens; 40 held out -> 4 sequences


def arange_config(tmp_path, **kwargs) -> DataConfig:
    """A token corpus whose ids are their positions, so every sequence says where it came from."""
    if not (tmp_path / "ids.npy").exists():  # rewriting a file another iterator maps: SIGBUS
        np.save(tmp_path / "ids.npy", np.arange(NUM_TOKENS, dtype=np.uint32))
    defaults = {"validation_batches": 2}
    return DataConfig(
        source="tokens",
        path=str(tmp_path / "ids.npy"),
        tokens_vocab_size=NUM_TOKENS,
        **(defaults | kwargs),
    )


def take(iterator, n):
    return list(itertools.islice(iterator, n))


def sequence_ids(batches):
    return [int(x) // SEQ_LEN for b in batches for x in b["inputs"][:, 0]]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def test_batches_are_int32_and_shifted(tmp_path):
    datasets = make_datasets(arange_config(tmp_path), seq_len=SEQ_LEN, batch_size=4, seed=0)
    assert datasets.vocab_size == NUM_TOKENS
    batch = next(datasets.train_iterator())
    assert set(batch) == {"inputs", "targets"}
    for key in batch:
        assert batch[key].shape == (4, SEQ_LEN) and batch[key].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)


def test_same_seed_same_batches_other_seed_other_order(tmp_path):
    cfg = arange_config(tmp_path)
    first = take(make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=3).train_iterator(), 10)
    again = take(make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=3).train_iterator(), 10)
    other = take(make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=4).train_iterator(), 10)
    assert_same_batches(first, again)
    assert sequence_ids(first) != sequence_ids(other)


def test_each_epoch_is_a_new_permutation_of_all_sequences(tmp_path):
    datasets = make_datasets(arange_config(tmp_path), seq_len=SEQ_LEN, batch_size=4, seed=0)
    assert len(datasets.train_sequences) == 244
    iterator = datasets.train_iterator()
    epoch_1 = sequence_ids(take(iterator, 61))
    epoch_2 = sequence_ids(take(iterator, 61))
    assert sorted(epoch_1) == sorted(epoch_2) == list(range(244))
    assert epoch_1 != epoch_2 and epoch_1 != list(range(244))


def test_without_shuffle_the_order_is_the_corpus_order(tmp_path):
    cfg = arange_config(tmp_path, shuffle=False)
    batches = take(make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=0).train_iterator(), 62)
    assert sequence_ids(batches) == list(range(244)) + [0, 1, 2, 3]


@pytest.mark.parametrize("consumed", [7, 59])  # 59 + 5 crosses the epoch boundary at 61
def test_resume_from_state_continues_with_the_same_batches(tmp_path, consumed):
    cfg = arange_config(tmp_path)
    iterator = make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=1).train_iterator()
    take(iterator, consumed)
    state = iterator.get_state()
    expected = take(iterator, 5)
    fresh = make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=1).train_iterator()
    fresh.set_state(state)
    assert_same_batches(take(fresh, 5), expected)


def test_state_of_another_corpus_is_rejected(tmp_path):
    iterator = make_datasets(arange_config(tmp_path), seq_len=SEQ_LEN, batch_size=4, seed=1)
    state = iterator.train_iterator().get_state()
    synthetic = DataConfig(source="synthetic", synthetic_tokens=NUM_TOKENS, validation_batches=2)
    other = make_datasets(synthetic, seq_len=SEQ_LEN, batch_size=4, seed=1).train_iterator()
    with pytest.raises(ValueError, match="DataSource in checkpoint does not match"):
        other.set_state(state)


def test_processes_read_disjoint_shards_that_cover_the_corpus(tmp_path):
    cfg = arange_config(tmp_path)
    seen = []
    for index in range(2):
        datasets = make_datasets(
            cfg, seq_len=SEQ_LEN, batch_size=4, seed=0, process_index=index, process_count=2
        )
        assert datasets.batch_size == 2
        seen.append(set(sequence_ids(take(datasets.train_iterator(), 61))))
        assert len(seen[-1]) == 122
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(244))


def test_validation_is_fixed_held_out_and_disjoint(tmp_path):
    datasets = make_datasets(arange_config(tmp_path), seq_len=SEQ_LEN, batch_size=2, seed=0)
    first, second = datasets.validation_batches(), datasets.validation_batches()
    assert len(first) == 2
    assert_same_batches(first, second)
    train_max = max(int(b["targets"].max()) for b in take(datasets.train_iterator(), 122))
    assert train_max < 1960 <= min(int(b["inputs"].min()) for b in first)


def test_validation_returns_what_the_split_holds_or_nothing(tmp_path):
    few = make_datasets(
        arange_config(tmp_path, validation_batches=50), seq_len=SEQ_LEN, batch_size=2, seed=0
    )
    assert len(few.validation_batches()) == 2  # 4 held-out sequences
    cfg = arange_config(tmp_path, validation_fraction=0.0, validation_batches=0)
    assert make_datasets(cfg, seq_len=SEQ_LEN, batch_size=2, seed=0).validation_batches() == []


def test_validation_split_too_small(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"validation split has 40 tokens = 4 sequences .* needs 8; raise data\.validation_fraction",
    ):
        make_datasets(arange_config(tmp_path), seq_len=SEQ_LEN, batch_size=8, seed=0)


def test_corpus_too_short_for_one_batch(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"training split has 1960 tokens = 1 sequences of seq_len\+1=1025 tokens, but one batch needs 2",
    ):
        make_datasets(arange_config(tmp_path), seq_len=1024, batch_size=2, seed=0)


def test_token_id_outside_the_vocabulary(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3, 70_000] * 100, dtype=np.uint32))
    cfg = DataConfig(source="tokens", path=str(tmp_path / "ids.npy"), tokens_vocab_size=50_257)
    with pytest.raises(
        ValueError, match=r"holds token id 70000, outside the vocabulary \[0, 50257\)"
    ):
        make_datasets(cfg, seq_len=4, batch_size=2, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, r"seq_len must be >= 1, got 0"),
        (
            {"batch_size": 3, "process_count": 2},
            r"batch_size must be a positive multiple of process_count=2, got 3",
        ),
        (
            {"process_index": 2, "process_count": 2},
            r"0 <= process_index < process_count, got process_index=2",
        ),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\) for grain's shuffle, got -1"),
    ],
)
def test_bad_arguments(kwargs, message):
    arguments = {"seq_len": 8, "batch_size": 2, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        make_datasets(DataConfig(source="synthetic", synthetic_tokens=1000), **arguments)


def test_missing_text_path(tmp_path):
    cfg = DataConfig(source="text", path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"data\.path: '.*missing' does not exist"):
        make_datasets(cfg, seq_len=8, batch_size=2, seed=0)


def test_builtin_default_is_english_bytes():
    datasets = make_datasets(DataConfig(), seq_len=64, batch_size=4, seed=0)
    assert datasets.vocab_size == 257 and datasets.tokenizer.eos_id == 256
    text = datasets.tokenizer.decode(next(datasets.train_iterator())["inputs"][0])
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)
    assert len(datasets.validation_batches()) == DataConfig().validation_batches
    held_out = datasets.tokenizer.decode(datasets.validation_batches()[-1]["targets"][-1])
    assert held_out in "\n".join(kjv_chapters()[-30:])  # from the end of Revelation's side


def test_text_files_with_bpe_trained_on_the_training_split(tmp_path):
    chapters = kjv_chapters()[:12]
    for i, chapter in enumerate(chapters):
        (tmp_path / f"{i:02d}.txt").write_text(chapter, encoding="utf-8")
    cfg = DataConfig(
        source="text",
        path=str(tmp_path),
        tokenizer="bpe",
        bpe_vocab_size=400,
        validation_fraction=0.1,
        validation_batches=1,
    )
    datasets = make_datasets(cfg, seq_len=32, batch_size=2, seed=0)
    train_documents, _ = split_documents(chapters, 0.1)
    assert (
        datasets.tokenizer.hf.to_str() == train_bpe(train_documents, 400, cfg.eos_token).hf.to_str()
    )
    assert datasets.vocab_size == 400
    batch = next(datasets.train_iterator())
    assert int(batch["inputs"].max()) < 400
    assert datasets.tokenizer.decode(batch["inputs"][0]).strip()


def test_bin_tokens_with_a_loaded_tokenizer(tmp_path):
    ByteTokenizer().save(tmp_path / "tok")
    ids = ByteTokenizer().encode_documents(["hello world"] * 50)
    ids.astype("<u2").tofile(tmp_path / "ids.bin")
    cfg = DataConfig(
        source="tokens",
        path=str(tmp_path / "ids.bin"),
        tokenizer_path=str(tmp_path / "tok"),
        validation_fraction=0.1,
        validation_batches=1,
    )
    datasets = make_datasets(cfg, seq_len=12, batch_size=2, seed=0)
    assert datasets.vocab_size == 257
    assert "hello world" in datasets.tokenizer.decode(
        datasets.validation_batches()[0]["inputs"].reshape(-1)
    )


def test_synthetic_source():
    cfg = DataConfig(source="synthetic", synthetic_vocab_size=64, synthetic_tokens=5000)
    datasets = make_datasets(cfg, seq_len=16, batch_size=4, seed=0)
    assert datasets.vocab_size == 64 and datasets.tokenizer.vocab_size == 64
    batch = next(datasets.train_iterator())
    steps = (batch["targets"] - batch["inputs"]) % 64
    assert set(np.unique(steps).tolist()) <= {1, 2, 3, 5}


def test_worker_processes_give_the_same_batches(tmp_path):
    cfg = arange_config(tmp_path)
    in_process = take(make_datasets(cfg, seq_len=SEQ_LEN, batch_size=4, seed=2).train_iterator(), 6)
    cfg_workers = arange_config(tmp_path, num_workers=1)
    iterator = make_datasets(cfg_workers, seq_len=SEQ_LEN, batch_size=4, seed=2).train_iterator()
    assert_same_batches(take(iterator, 6), in_process)


def walked_documents(row, eos_id):
    """The documents of a row, walked token by token: (segment ids, positions)."""
    segment, position, segments, positions = 0, 0, [], []
    for token in row.tolist():
        segments.append(segment)
        positions.append(position)
        position += 1
        if token == eos_id:  # the separator ends its document; the next token starts one
            segment, position = segment + 1, 0
    return segments, positions


def documents_config(tmp_path, **kwargs) -> DataConfig:
    """Text documents of 1 to 20 bytes (byte tokens, eos 256): several documents per row."""
    corpus = tmp_path / "documents"
    if not corpus.exists():
        corpus.mkdir()
        rng = np.random.default_rng(0)
        for i in range(300):
            (corpus / f"{i:03d}.txt").write_text("x" * int(rng.integers(1, 21)), encoding="utf-8")
    return DataConfig(
        source="text", path=str(corpus), validation_fraction=0.1, validation_batches=1, **kwargs
    )


def test_text_batches_carry_their_documents_and_resume_with_them(tmp_path):
    datasets = make_datasets(documents_config(tmp_path), seq_len=32, batch_size=4, seed=0)
    assert datasets.documents == "data: document masks at separator id 256 (data.document_mask)"
    iterator = datasets.train_iterator()
    batches = take(iterator, 3)
    for batch in [*batches, *datasets.validation_batches()]:
        assert set(batch) == {"inputs", "targets", "segment_ids", "positions"}
        for row, segment_ids, positions in zip(
            batch["inputs"], batch["segment_ids"], batch["positions"], strict=True
        ):
            assert segment_ids.dtype == positions.dtype == np.int32
            assert (segment_ids.tolist(), positions.tolist()) == walked_documents(row, 256)
    assert max(int(b["segment_ids"].max()) for b in batches) >= 3  # rows really hold several
    state = iterator.get_state()
    expected = take(iterator, 2)
    fresh = make_datasets(documents_config(tmp_path), seq_len=32, batch_size=4, seed=0)
    resumed = fresh.train_iterator()
    resumed.set_state(state)
    assert_same_batches(take(resumed, 2), expected)


def test_document_mask_off_gives_the_same_tokens_without_documents(tmp_path):
    on = make_datasets(documents_config(tmp_path), seq_len=32, batch_size=4, seed=0)
    off = make_datasets(
        documents_config(tmp_path, document_mask=False), seq_len=32, batch_size=4, seed=0
    )
    assert off.documents == "data: no document masks (data.document_mask=false)"
    with_documents, without = next(on.train_iterator()), next(off.train_iterator())
    assert set(without) == {"inputs", "targets"}
    assert_same_batches([{k: with_documents[k] for k in without}], [without])


@pytest.mark.parametrize(
    ("source", "why"),
    [
        (
            {"source": "synthetic", "synthetic_tokens": 2000},
            "the synthetic stream has no documents",
        ),
        ("arange", "a tokens corpus without data.tokenizer_path has no separator id"),
        ("no eos", "data.eos_token is '', so documents are joined without a separator"),
    ],
)
def test_corpora_without_separators_say_so_and_refuse_a_required_mask(tmp_path, source, why):
    def config(mask):
        if source == "arange":
            return arange_config(tmp_path, document_mask=mask)
        if source == "no eos":
            return documents_config(tmp_path, eos_token="", document_mask=mask)
        return DataConfig(**source, validation_batches=1, document_mask=mask)

    datasets = make_datasets(config("auto"), seq_len=SEQ_LEN, batch_size=2, seed=0)
    assert (
        datasets.documents == f"data: no document masks ({why}): every row attends as one document"
    )
    assert set(next(datasets.train_iterator())) == {"inputs", "targets"}
    message = rf"^data\.document_mask=true needs document separators, but {why}; set data\."
    with pytest.raises(ValueError, match=message):
        make_datasets(config(True), seq_len=SEQ_LEN, batch_size=2, seed=0)


def test_document_mask_values_and_old_saved_configs():
    from nvfp4_train.config.loader import to_dict
    from nvfp4_train.config.run_config import ConfigError, config_from_dict, upgraded

    assert config_from_dict({}).data.document_mask == "auto"
    assert config_from_dict({"data": {"document_mask": False}}).data.document_mask is False
    with pytest.raises(ConfigError, match=r"^data\.document_mask: expected bool or one of 'auto'"):
        config_from_dict({"data": {"document_mask": "yes"}})
    with pytest.raises(TypeError, match=r"data\.document_mask must be true, false or 'auto'"):
        DataConfig(document_mask="yes")
    saved = to_dict(config_from_dict({}))
    del saved["data"]["document_mask"]  # written before the key: trained across documents
    assert config_from_dict(upgraded(saved)).data.document_mask is False


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"path": "corpsu/"}, r"^data\.path: 'corpsu/' does not exist$"),
        ({"path": "builtin"}, r"'builtin' does not exist \(the built-in corpus is data\.source="),
        ({"mixture": (MixtureSource("web/"), MixtureSource("cdoe/"))},
         r"^data\.mixture: 'web/' does not exist$"),
    ],
)  # fmt: skip
def test_a_mistyped_tokens_path_is_named(fields, message):
    with pytest.raises(DataError, match=message):
        make_datasets(DataConfig(source="tokens", **fields), seq_len=8, batch_size=2, seed=0)


def _mixed(tmp_path, weights):
    return DataConfig(source="tokens", tokens_vocab_size=NUM_TOKENS, validation_batches=2,
                      mixture=tuple(MixtureSource(arange_config(tmp_path).path, w) for w in weights))  # fmt: skip


RESUME_CHANGES = {  # what changed: (config, seed, seq_len, the message naming it)
    "train.seed": (arange_config, 2, SEQ_LEN, r"train\.seed \(1 in the checkpoint, 2 now\)"),
    "train.seq_len": (arange_config, 1, 4, r"train\.seq_len \(8 in the checkpoint, 4 now\) changed"),
    "data.shuffle": (lambda p: arange_config(p, shuffle=False), 1, SEQ_LEN, r"data\.shuffle \(True"),
    "data.source": (
        lambda _: DataConfig(source="synthetic", synthetic_tokens=NUM_TOKENS, validation_batches=2),
        1, SEQ_LEN, r"the vocabulary .* \(2000 in the checkpoint, 256 now\); the corpus \(data\.source",
    ),
    "data.mixture": (lambda p: _mixed(p, (1, 1)), 1, SEQ_LEN, r"data\.mixture \(none in the checkpoint, 2 sources now\) changed"),
}  # fmt: skip


@pytest.mark.parametrize("change", list(RESUME_CHANGES))
def test_resuming_with_a_changed_data_setting_names_it(tmp_path, change):
    def iterator(cfg, seed, seq_len):
        return make_datasets(cfg, seq_len=seq_len, batch_size=4, seed=seed).train_iterator()

    saved = iterator(arange_config(tmp_path), 1, SEQ_LEN)
    next(saved)
    config, seed, seq_len, message = RESUME_CHANGES[change]
    with pytest.raises(DataError, match=r"^cannot resume the training data from the checkpoint: "
                       + message + r".*the run's data order depends on it"):  # fmt: skip
        restore_iterator_state(iterator(config(tmp_path), seed, seq_len), saved.get_state())
    same = iterator(arange_config(tmp_path), 1, SEQ_LEN)
    restore_iterator_state(same, saved.get_state())  # unchanged: restored
    assert_same_batches([next(same)], [next(saved)])


def test_resuming_a_mixture_with_other_weights_names_them(tmp_path):
    saved = make_datasets(_mixed(tmp_path, (1, 1)), seq_len=8, batch_size=4, seed=0)
    other = make_datasets(_mixed(tmp_path, (3, 1)), seq_len=8, batch_size=4, seed=0)
    with pytest.raises(DataError, match=r"data\.mixture weights \(1, 1 in the checkpoint, 3, 1 "):
        restore_iterator_state(other.train_iterator(), saved.train_iterator().get_state())
