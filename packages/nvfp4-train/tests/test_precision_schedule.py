"""`precision.bf16_forward_from`: the late switch of the forward GEMMs to BF16, across resumes."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from run_reading import saved_params, train_losses, val_losses
from run_steps import initial

import nvfp4_ops
from nvfp4_train.config.loader import to_dict
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.errors import ConfigError
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.precision.policy import PrecisionConfig, bf16_forward_start, layer_recipes
from nvfp4_train.training.evaluation import evaluate_run
from nvfp4_train.training.resume import check_same_model
from nvfp4_train.training.run import run
from nvfp4_train.training.step import model_graphdef, model_spec

STEPS, SWITCH = 6, 3
SECTIONS = {
    "train": {"steps": STEPS, "log_every": 1, "eval_every": SWITCH},
    "checkpoint": {"every_steps": 1, "keep": STEPS, "reference_sequences": 0},
}


# ----------------------------------------------------------------------------- config and policy


@pytest.mark.parametrize(
    ("value", "steps", "start"),
    [(None, 100, None), (0.82, 1000, 820), (0.5, 6, 3), (0.25, 6, 2), (1.0, 7, 7), (0, 9, 0),
     (30, 9, 30)],
)  # fmt: skip
def test_bf16_forward_start_resolves_fractions_and_steps(value, steps, start):
    assert bf16_forward_start(PrecisionConfig(bf16_forward_from=value), steps) == start


@pytest.mark.parametrize(
    ("value", "match"),
    [(-1, "got the step -1"), (1.5, "got the fraction 1.5"), (0.0, "got the fraction 0.0"),
     (float("nan"), "got the fraction nan"), (True, "got True"), ("0.8", "got '0.8'")],
)  # fmt: skip
def test_bad_bf16_forward_from_is_a_value_error(value, match):
    with pytest.raises(ValueError, match=rf"precision\.bf16_forward_from must be .*{match}"):
        PrecisionConfig(bf16_forward_from=value)


@pytest.mark.parametrize(("text", "expected"), [("0.82", 0.82), ("3", 3), ("1", 1), ("1.0", 1.0)])
def test_yaml_ints_are_steps_and_floats_are_fractions(text, expected):
    cfg = config_from_dict({}, [f"precision.bf16_forward_from={text}"])
    assert cfg.precision.bf16_forward_from == expected
    assert type(cfg.precision.bf16_forward_from) is type(expected)


@pytest.mark.parametrize("text", ["true", "late", "-2", "2.5"])
def test_bad_yaml_values_are_config_errors(text):
    with pytest.raises(ConfigError, match="bf16_forward_from"):
        config_from_dict({}, [f"precision.bf16_forward_from={text}"])


def test_late_recipes_switch_only_the_quantized_linears():
    model = ModelConfig(
        vocab_size=64, d_model=32, num_layers=4, num_heads=2, num_kv_heads=1, mlp_dim=64,
        max_seq_len=16,
    )  # fmt: skip
    precision = PrecisionConfig(recipe="nvfp4", bf16_forward_from=0.5)
    early = layer_recipes(model, precision)
    late = layer_recipes(model, precision, bf16_forward=True)
    assert early.keys() == late.keys()
    for path, recipe in early.items():
        assert late[path] == recipe.with_bf16_fprop()
        assert late[path].bf16_fprop == recipe.quantized
    assert late["layers.0.attn.qkv"] == nvfp4_ops.get_recipe("bf16")
    assert late["layers.1.mlp.down"].name == "nvfp4+bf16-fprop"


def test_late_graphdef_takes_the_same_params_with_bf16_fprop_recipes(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path), ["model.vocab_size=64", "train.seed=5"])
    graphdef, state = initial(cfg)
    assert model_graphdef(model_spec(cfg)) == graphdef
    late = nnx.merge(
        model_graphdef(model_spec(cfg), layer_recipes(cfg.model, cfg.precision, bf16_forward=True)),
        state.params,
    )
    assert late.layers["0"].mlp.down.recipe == nvfp4_ops.get_recipe("nvfp4").with_bf16_fprop()
    assert nnx.to_pure_dict(nnx.state(late)).keys() == state.params.keys()


def test_checkpoints_written_before_the_field_existed_still_resume(tmp_path):
    cfg = config_from_dict({})
    saved = to_dict(cfg)
    del saved["precision"]["bf16_forward_from"]
    check_same_model(cfg, saved, tmp_path)  # absent = the default (None): the same run
    switched = config_from_dict({}, ["precision.bf16_forward_from=0.8"])
    with pytest.raises(ConfigError, match=r"precision\.bf16_forward_from differ"):
        check_same_model(switched, saved, tmp_path)


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class ScheduleRuns:
    switched: Path
    switched_output: str
    plain: Path
    resumed: dict[int, tuple[Path, str]]


def _run(tiny_config, run_dir: Path, *overrides: str) -> str:
    out = io.StringIO()
    run(config_from_dict(tiny_config(run_dir, **SECTIONS), overrides), stream=out)
    return out.getvalue()


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory, tiny_config) -> ScheduleRuns:
    """A 6-step run switching at step 3, the same without the switch, and the first run resumed
    from its checkpoints 2 and 4 (later checkpoints and metrics rows dropped)."""
    root = tmp_path_factory.mktemp("schedule")
    switch = f"precision.bf16_forward_from={SWITCH}"
    output = _run(tiny_config, root / "switched", switch)
    _run(tiny_config, root / "plain")
    resumed = {}
    for step in (2, 4):
        run_dir = root / f"resumed-{step}"
        shutil.copytree(root / "switched", run_dir)
        for later in range(step + 1, STEPS + 1):
            shutil.rmtree(run_dir / "checkpoints" / str(later))
        resumed[step] = (run_dir, _run(tiny_config, run_dir, switch))
    return ScheduleRuns(root / "switched", output, root / "plain", resumed)


def test_losses_match_the_plain_run_until_the_switch_and_differ_after(schedule_runs):
    switched, plain = train_losses(schedule_runs.switched), train_losses(schedule_runs.plain)
    assert [s for s, _ in switched] == [s for s, _ in plain] == list(range(1, STEPS + 1))
    assert switched[:SWITCH] == plain[:SWITCH]
    for (_, late), (_, quantized) in zip(switched[SWITCH:], plain[SWITCH:], strict=True):
        assert late != quantized
    assert np.all(np.isfinite([loss for _, loss in switched]))


def test_validation_after_the_switch_uses_the_bf16_forward(schedule_runs):
    switched, plain = val_losses(schedule_runs.switched), val_losses(schedule_runs.plain)
    assert sorted(switched) == sorted(plain) == [SWITCH, STEPS]
    np.testing.assert_array_equal(
        saved_params(schedule_runs.switched, SWITCH)["embed"]["embedding"],
        saved_params(schedule_runs.plain, SWITCH)["embed"]["embedding"],
    )  # same model at the switch: only its forward differs
    assert switched[SWITCH] != plain[SWITCH]


def test_the_switch_is_announced_once(schedule_runs):
    out = schedule_runs.switched_output
    line = (
        f"step {SWITCH}: forward GEMMs of the quantized linears now run in BF16 "
        f"(precision.bf16_forward_from={SWITCH})"
    )
    assert out.count("forward GEMMs") == 1 and line in out
    assert out.count("compiled the train step") == 2


def test_explicit_rule_trains_bit_identically_to_bf16_forward_from(
    schedule_runs, tiny_config, tmp_path
):
    rule = {"gemms": ["fprop"], "from": SWITCH, "recipe": "bf16"}
    explicit = _run(tiny_config, tmp_path / "explicit", f"precision.schedule={json.dumps([rule])}")
    assert f"step {SWITCH}: precision phase 2 of 2, completed steps [{SWITCH}, end), starts:" in (
        explicit
    )
    assert train_losses(tmp_path / "explicit") == train_losses(schedule_runs.switched)
    assert val_losses(tmp_path / "explicit") == val_losses(schedule_runs.switched)
    for step in (SWITCH, STEPS):
        jax.tree.map(
            np.testing.assert_array_equal,
            saved_params(tmp_path / "explicit", step),
            saved_params(schedule_runs.switched, step),
        )


@pytest.mark.parametrize("stop", [2, 4])
def test_resume_before_or_after_the_switch_is_bit_identical(schedule_runs, stop):
    run_dir, output = schedule_runs.resumed[stop]
    assert f"resumed from {run_dir / 'checkpoints' / str(stop)}" in output
    assert train_losses(run_dir) == train_losses(schedule_runs.switched)
    assert val_losses(run_dir) == val_losses(schedule_runs.switched)
    for step in (SWITCH + 1, STEPS):
        jax.tree.map(
            np.testing.assert_array_equal,
            saved_params(run_dir, step),
            saved_params(schedule_runs.switched, step),
        )
    if stop < SWITCH:
        assert f"step {SWITCH}: forward GEMMs of the quantized linears now run in BF16" in output
    else:
        assert f"step {stop}: forward GEMMs of the quantized linears run (since step {SWITCH})" in (
            output
        )


def test_evaluate_run_uses_the_forward_of_the_checkpoint_step(schedule_runs, tmp_path):
    run_dir = tmp_path / "at-switch"  # newest checkpoint: the switch step
    shutil.copytree(schedule_runs.switched, run_dir)
    for later in range(SWITCH + 1, STEPS + 1):
        shutil.rmtree(run_dir / "checkpoints" / str(later))
    row = evaluate_run(run_dir, stream=io.StringIO())
    assert row["step"] == SWITCH
    assert row["val_loss"] == pytest.approx(val_losses(run_dir)[SWITCH], rel=1e-6)
    assert row["val_loss"] != pytest.approx(val_losses(schedule_runs.plain)[SWITCH], rel=1e-6)


def test_evaluate_run_forward_choice_overrides_the_schedule(schedule_runs, tmp_path):
    run_dir = tmp_path / "at-switch"
    shutil.copytree(schedule_runs.switched, run_dir)
    for later in range(SWITCH + 1, STEPS + 1):
        shutil.rmtree(run_dir / "checkpoints" / str(later))
    quantized = evaluate_run(run_dir, forward="quantized", stream=io.StringIO())
    bf16 = evaluate_run(run_dir, forward="bf16", stream=io.StringIO())
    # params at the switch are the plain run's: its quantized validation, and the switched one's
    assert quantized["val_loss"] == pytest.approx(val_losses(schedule_runs.plain)[SWITCH], rel=1e-6)
    assert bf16["val_loss"] == pytest.approx(val_losses(run_dir)[SWITCH], rel=1e-6)
    assert (quantized["forward"], bf16["forward"]) == ("quantized", "bf16")
    with pytest.raises(ValueError, match="forward must be one of"):
        evaluate_run(run_dir, forward="fp4", stream=io.StringIO())
