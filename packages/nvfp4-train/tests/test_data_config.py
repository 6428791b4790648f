"""DataConfig: defaults, value checks and their messages."""

import dataclasses

import pytest

from nvfp4_train.data import DataConfig, MixtureSource


def test_defaults_are_the_builtin_byte_corpus():
    cfg = DataConfig()
    assert (cfg.source, cfg.tokenizer, cfg.shuffle, cfg.num_workers) == ("builtin", "byte", True, 0)
    assert 0 < cfg.validation_fraction <= 0.5 and cfg.validation_batches > 0


def test_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DataConfig().source = "text"  # type: ignore[misc]


def test_fields_are_plain_types():
    for field in dataclasses.fields(DataConfig):
        value = getattr(DataConfig(), field.name)
        assert type(value) in (str, int, float, bool) or field.name == "mixture", field.name
    assert DataConfig().mixture == ()


def test_mixture_from_yaml_mappings():
    from nvfp4_train.config.loader import build

    cfg = build(
        DataConfig, {"source": "tokens", "mixture": [{"path": "a", "weight": 3}, {"path": "b"}]}
    )
    assert cfg.mixture == (MixtureSource("a", 3), MixtureSource("b", 1.0))
    with pytest.raises(ValueError, match=r"weight of 'b' must be > 0, got 0"):
        build(DataConfig, {"source": "tokens", "mixture": [{"path": "b", "weight": 0}]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"source": "web"},
            r"data\.source must be one of 'builtin', 'synthetic', 'text', 'tokens', got 'web'",
        ),
        (
            {"tokenizer": "sentencepiece"},
            r"data\.tokenizer must be one of 'byte', 'bpe', got 'sentencepiece'",
        ),
        (
            {"tokens_dtype": "int8"},
            r"data\.tokens_dtype must be one of 'uint16', 'uint32', got 'int8'",
        ),
        ({"source": "text"}, r"data\.path must name a file or directory for source='text'"),
        ({"source": "tokens"}, r"data\.path \(or data\.mixture\) must name the corpus"),
        (
            {"mixture": (MixtureSource("a"),)},
            r"data\.mixture replaces data\.path and needs source='tokens', got source='builtin'",
        ),
        ({"bpe_vocab_size": 100}, r"data\.bpe_vocab_size must be in \[257, .*got 100"),
        (
            {"validation_fraction": 0.9},
            r"data\.validation_fraction must be in \[0\.0, 0\.5\], got 0\.9",
        ),
        ({"validation_fraction": 0.0}, r"data\.validation_batches=0 too \(got 8\)"),
        ({"num_workers": -1}, r"data\.num_workers must be in \[0, 1024\], got -1"),
        ({"synthetic_vocab_size": 1}, r"data\.synthetic_vocab_size must be in \[2, "),
        ({"text_glob": ""}, r"data\.text_glob must be a non-empty pattern"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shuffle": 1}, r"data\.shuffle must be bool, got 1 \(int\)"),
        ({"validation_batches": 2.0}, r"data\.validation_batches must be int, got 2\.0 \(float\)"),
        ({"num_workers": True}, r"data\.num_workers must be int, got True \(bool\)"),
        ({"path": 3}, r"data\.path must be str, got 3 \(int\)"),
    ],
)
def test_wrong_types_are_type_errors(kwargs, message):
    with pytest.raises(TypeError, match=message):
        DataConfig(**kwargs)


def test_validation_can_be_switched_off_and_a_float_field_takes_an_int():
    cfg = DataConfig(validation_fraction=0, validation_batches=0)
    assert (cfg.validation_fraction, cfg.validation_batches) == (0, 0)
