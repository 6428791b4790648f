"""The config tree: defaults, loading, overrides, and errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest
import yaml

from nvfp4_train.config.loader import apply_overrides, build, parse_override, to_dict, to_yaml
from nvfp4_train.config.run_config import Config, config_from_dict, load_config, upgraded
from nvfp4_train.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def test_defaults_build_and_required_keys_exist():
    cfg = config_from_dict({})
    assert cfg == Config()
    assert isinstance(cfg.output_dir, str)
    assert cfg.train.steps > 0 and isinstance(cfg.train.seed, int)
    assert cfg.checkpoint.every_steps >= 0
    assert cfg.precision.recipe == "nvfp4"


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3  # type: ignore[misc]


def test_values_from_mapping_land_in_sections():
    cfg = config_from_dict(
        {"output_dir": "runs/a", "train": {"steps": 7, "seed": 3}, "model": {"num_layers": 2}}
    )
    assert (cfg.output_dir, cfg.train.steps, cfg.train.seed, cfg.model.num_layers) == (
        "runs/a", 7, 3, 2,
    )  # fmt: skip
    assert cfg.train.batch_size == Config().train.batch_size  # untouched keys keep defaults


@pytest.mark.parametrize(
    ("mapping", "needles"),
    [
        ({"trian": {}}, ["'trian'", "did you mean 'train'", "allowed keys", "checkpoint"]),
        ({"train": {"step": 3}}, ["'train.step'", "did you mean 'steps'", "seq_len"]),
        ({"model": {"zzz": 1}}, ["'model.zzz'", "allowed keys", "num_layers"]),
    ],
)
def test_unknown_key_names_it_and_lists_allowed(mapping, needles):
    with pytest.raises(ConfigError) as e:
        config_from_dict(mapping)
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize(
    ("mapping", "needles"),
    [
        ({"train": {"steps": "many"}}, ["train.steps", "expected int", "'many'"]),
        ({"train": {"steps": 2.5}}, ["train.steps", "expected int", "2.5"]),
        ({"train": {"steps": True}}, ["train.steps", "expected int", "True"]),
        ({"logging": {"tensorboard": "yes"}}, ["logging.tensorboard", "expected bool"]),
        ({"logging": {"progress": "fancy"}}, ["logging.progress", "'rich'", "'fancy'"]),
        ({"train": 5}, ["train", "expected a mapping", "5"]),
        ({"output_dir": 3}, ["output_dir", "expected str", "3"]),
        ({"train": {"eval_batches": "x"}}, ["train.eval_batches", "int or null", "'x'"]),
    ],
)
def test_wrong_type_names_key_expected_and_value(mapping, needles):
    with pytest.raises(ConfigError) as e:
        config_from_dict(mapping)
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize(
    ("mapping", "needles"),
    [
        ({"train": {"steps": 0}}, ["train.steps", ">= 1", "0"]),
        ({"train": {"batch_size": 6, "grad_accum_steps": 4}}, ["grad_accum_steps", "6"]),
        ({"checkpoint": {"keep": 0}}, ["checkpoint.keep"]),
        ({"precision": {"recipe": "nvfp5"}}, ["precision.recipe", "nvfp5"]),
        ({"train": {"seq_len": 512}, "model": {"max_seq_len": 256}}, ["train.seq_len", "256"]),
    ],
)
def test_invalid_value_is_an_error_naming_the_key(mapping, needles):
    with pytest.raises(ValueError) as e:
        config_from_dict(mapping)
    for needle in needles:
        assert needle in str(e.value)


def test_overrides_apply_and_parse_values_as_yaml():
    cfg = config_from_dict(
        {"model": {"num_layers": 6}},
        overrides=[
            "model.num_layers=4",
            "precision.recipe=bf16",
            "optimizer.learning_rate=1e-3",
            "train.eval_batches=null",
            "logging.tensorboard=false",
            "precision.overrides=['layers\\.0\\..*=bf16']",
            "output_dir=runs/x",
        ],
    )
    assert cfg.model.num_layers == 4
    assert cfg.precision.recipe == "bf16"
    assert cfg.optimizer.learning_rate == pytest.approx(1e-3)
    assert cfg.train.eval_batches is None
    assert cfg.logging.tensorboard is False
    assert cfg.precision.overrides == ("layers\\.0\\..*=bf16",)
    assert cfg.output_dir == "runs/x"


def test_later_override_wins_and_input_is_not_mutated():
    mapping = {"train": {"steps": 5}}
    result = apply_overrides(mapping, ["train.steps=6", "train.steps=7"])
    assert result == {"train": {"steps": 7}}
    assert mapping == {"train": {"steps": 5}}


def test_a_mapping_override_updates_the_section_it_names():
    """`optimizer={learning_rate: 0.01}` sets that key and keeps the section's others (it once
    replaced the whole section: warmup_steps fell back to its default without a word)."""
    cfg = load_config(REPO / "examples/configs/tiny.yaml", ["optimizer={learning_rate: 0.01}"])
    assert cfg.optimizer.learning_rate == 0.01 and cfg.optimizer.warmup_steps == 20
    nested = apply_overrides({"model": {"moe": {"num_experts": 8, "expert_mlp_dim": 64}}},
                             ["model={moe: {num_experts: 4}, d_model: 32}"])  # fmt: skip
    assert nested == {"model": {"moe": {"num_experts": 4, "expert_mlp_dim": 64}, "d_model": 32}}
    assert apply_overrides({"train": {"steps": 5}}, ["train.steps={a: 1}"]) == {
        "train": {"steps": {"a": 1}}
    }  # a value given a mapping is replaced (and then refused by the config's types)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("train.steps", "section.key=value"),
        ("=3", "section.key=value"),
        ("train..steps=3", "section.key=value"),
        ("train.steps=[1, 2", "not valid YAML"),
    ],
)
def test_bad_override_syntax(text, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        parse_override(text)


def test_override_into_a_value_and_unknown_override_key():
    with pytest.raises(ConfigError, match="'output_dir' is a value, not a section"):
        config_from_dict({"output_dir": "a"}, overrides=["output_dir.x=1"])
    with pytest.raises(ConfigError, match="output_dir: expected str, got {'x': 1}"):
        config_from_dict({}, overrides=["output_dir.x=1"])
    with pytest.raises(ConfigError, match="'train.stepz'.*did you mean 'steps'"):
        config_from_dict({}, overrides=["train.stepz=1"])


def test_float_written_without_dot_is_accepted():
    # YAML 1.1 (PyYAML) reads `3e-4` as a string; a float field accepts it.
    cfg = config_from_dict(yaml.safe_load("optimizer:\n  learning_rate: 3e-4\n"))
    assert cfg.optimizer.learning_rate == pytest.approx(3e-4)


def test_yaml_round_trip(tmp_path):
    cfg = config_from_dict({"train": {"steps": 9}}, ["precision.recipe=fp8", "model.num_layers=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert to_dict(cfg)["precision"]["recipe"] == "fp8"
    assert list(to_dict(cfg)) == [f.name for f in dataclasses.fields(Config)]


def test_load_config_errors_and_no_side_effects(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(scalar)
    good = tmp_path / "good.yaml"
    good.write_text(f"output_dir: {tmp_path / 'never'}\n")
    load_config(good)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load(path):
    if "init_from: path/to/" in path.read_text():  # a placeholder for the reader's own model
        with pytest.raises(ConfigError, match="model.init_from: 'path/to/.*' is not a directory"):
            load_config(path)
        return  # loaded with a model directory in test_hf_import.py
    cfg = load_config(path)
    assert cfg.train.steps > 0


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"tiny.yaml", "small.yaml", "llama3-8b-blackwell.yaml"}


@dataclasses.dataclass(frozen=True)
class _Inner:
    size: tuple[int, int] = (1, 2)
    names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    table: dict[str, float] = dataclasses.field(default_factory=dict)
    mode: Literal["a", "b"] = "a"
    limit: int | None = None


def test_generic_builder_handles_tuples_dicts_literals_optionals():
    built = build(
        _Outer,
        {"inner": {"size": [3, 4], "names": ["x"]}, "table": {"k": 1}, "mode": "b", "limit": 2},
    )
    assert built == _Outer(_Inner((3, 4), ("x",)), {"k": 1.0}, "b", 2)
    with pytest.raises(ConfigError, match=r"inner\.size: expected tuple\[int, int\], got \[3\]"):
        build(_Outer, {"inner": {"size": [3]}})
    with pytest.raises(ConfigError, match=r"inner\.names\[1\]: expected str, got 5"):
        build(_Outer, {"inner": {"names": ["x", 5]}})
    with pytest.raises(ConfigError, match=r"table\.k: expected float"):
        build(_Outer, {"table": {"k": "big"}})
    with pytest.raises(ConfigError, match=r"mode: expected one of 'a', 'b', got 'c'"):
        build(_Outer, {"mode": "c"})


def test_readme_documents_every_key_with_its_default():
    readme = (REPO / "packages" / "nvfp4-train" / "README.md").read_text()

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            dotted = f"{prefix}{key}"
            yield from leaves(value, dotted + ".") if isinstance(value, dict) else [dotted]

    for key in leaves(to_dict(Config())):
        parts = key.split(".")
        documented = [".".join(parts[:n]) for n in range(len(parts), 1, -1)] or parts
        assert any(f"| `{k}` |" in readme for k in documented), f"README config table lacks {key}"


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("precision.loss_scaling", "optimizer.loss_scaling.mode", "dynamic"),
        ("precision.initial_loss_scale", "optimizer.loss_scaling.initial_scale", 64.0),
        ("precision.loss_scale_growth_interval", "optimizer.loss_scaling.growth_interval", 5),
        ("precision.skip_nonfinite", "optimizer.loss_scaling.skip_nonfinite", False),
    ],
)
def test_moved_keys_are_refused_with_their_new_place_and_upgraded_when_saved(old, new, value):
    section, key = old.split(".")
    message = f"config key '{old}' moved to '{new}'"
    with pytest.raises(ConfigError, match=message):
        config_from_dict({section: {key: value}})
    with pytest.raises(ConfigError, match=message):
        config_from_dict({}, [f"{old}={value}"])
    saved = to_dict(Config())
    del saved["optimizer"]["loss_scaling"]
    saved["precision"][key] = value
    if key == "skip_nonfinite":  # the only old setting dynamic scaling forbids
        saved["precision"]["loss_scaling"] = "none"
    cfg = config_from_dict(upgraded(saved))
    got = cfg
    for part in new.split("."):
        got = getattr(got, part)
    assert got == value
    assert config_from_dict(upgraded(to_dict(cfg))) == cfg  # a current config is left as it is


def test_upgrade_keeps_a_new_key_already_set():
    saved = {
        "precision": {"loss_scaling": "dynamic"},
        "optimizer": {"loss_scaling": {"mode": "none"}},
    }
    assert upgraded(saved) == {"precision": {}, "optimizer": {"loss_scaling": {"mode": "none"}}}
    assert saved["precision"] == {"loss_scaling": "dynamic"}  # the input is not changed
