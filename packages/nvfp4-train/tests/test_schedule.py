"""`precision.schedule`: rules per GEMM, layer and step window; the older settings as its sugar;
phases, compile counts, show-config's table, checkpoints' recipes and exact resume across phases."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from run_reading import last_step, saved_params, start_run, train_losses, val_losses

import nvfp4_ops
from nvfp4_ops.recipe import compose
from nvfp4_train.cli import main
from nvfp4_train.config.loader import to_dict, to_yaml
from nvfp4_train.config.run_config import config_from_dict, load_config
from nvfp4_train.errors import ConfigError
from nvfp4_train.model.config import ModelConfig, linear_paths
from nvfp4_train.precision.policy import (
    PrecisionConfig,
    bf16_forward_start,
    export_recipe_names,
    layer_recipe_names,
    layer_recipes,
    precision_phases,
    run_layout,
)
from nvfp4_train.precision.schedule import ScheduleRule, phase_index
from nvfp4_train.training.resume import check_same_model
from nvfp4_train.training.run import run

NV, BF16 = nvfp4_ops.get_recipe("nvfp4"), nvfp4_ops.get_recipe("bf16")
THREE_PHASES = (
    ScheduleRule(gemms=("fprop",), from_=3, recipe="bf16"),
    ScheduleRule(layers=r"layers\.1\..*", gemms=("dgrad",), from_=6, recipe="nvfp4-no-sr"),
)
THREE_PHASES_YAML = [
    {"gemms": ["fprop"], "from": 3, "recipe": "bf16"},
    {"layers": r"layers\.1\..*", "gemms": ["dgrad"], "from": 6, "recipe": "nvfp4-no-sr"},
]


def model_cfg(num_layers: int = 4, **kwargs) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, d_model=32, num_layers=num_layers, num_heads=2, num_kv_heads=1,
        mlp_dim=64, max_seq_len=32, **kwargs,
    )  # fmt: skip


def quantized_everywhere(**kwargs) -> PrecisionConfig:
    return PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0, **kwargs)


# ----------------------------------------------------------------------------- rules


STEP_OR_FRACTION = "must be a step number (int >= 0) or a fraction of train.steps (float in (0, 1])"


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"layerz": "x", "recipe": "bf16"}, "unknown config key 'precision.schedule[0].layerz' "
         "(did you mean 'layers'?); allowed keys: layers, gemms, from, until, recipe"),
        ({"gemms": ["fwd"], "recipe": "bf16"}, "precision.schedule[0]: gemms: unknown GEMM 'fwd'"),
        ({"gemms": [], "recipe": "bf16"}, "precision.schedule[0]: gemms must be a non-empty list"),
        ({"gemms": "fprop", "recipe": "bf16"}, "precision.schedule[0].gemms: expected"),
        ({"layers": "layers.(", "recipe": "bf16"}, "layers: bad regex 'layers.('"),
        ({"recipe": "nvfp5"}, "precision.schedule[0]: recipe must be one of"),
        ({"from": 3}, "precision.schedule[0]: recipe is required"),
        ({"from": -1, "recipe": "bf16"}, f"from {STEP_OR_FRACTION}, got the step -1"),
        ({"from": 1.5, "recipe": "bf16"}, f"from {STEP_OR_FRACTION}, got the fraction 1.5"),
        ({"from": 0.0, "recipe": "bf16"}, f"from {STEP_OR_FRACTION}, got the fraction 0.0"),
        ({"until": True, "recipe": "bf16"}, "precision.schedule[0].until: expected"),
        ({"from": float("nan"), "recipe": "bf16"}, "from: expected int or float, got nan"),
        ({"until": float("inf"), "recipe": "bf16"}, "until: expected int or float or null"),
        ({"from": 5, "until": 5, "recipe": "bf16"}, "from must be < until, got from=5, until=5"),
        ({"from": 0.5, "until": 0.25, "recipe": "bf16"}, "from must be < until"),
    ],
)  # fmt: skip
def test_bad_rules_are_config_errors_naming_the_key(rule, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"precision": {"schedule": [rule]}})


def test_schedule_must_be_a_list_of_mappings():
    with pytest.raises(ConfigError, match="precision.schedule: expected a list of mappings"):
        config_from_dict({}, ["precision.schedule={recipe: bf16}"])
    with pytest.raises(ValueError, match=r"precision.schedule\[0\] must be a ScheduleRule"):
        PrecisionConfig(schedule=({"recipe": "bf16"},))


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (ScheduleRule(layers=r"layers\.9\..*", recipe="bf16"),
         r"precision.schedule\[1\] \(layers='layers\\\\.9\\\\..\*'\) matches no linear; paths "
         r"look like \['layers.0.attn.qkv', 'layers.0.attn.o', "),
        (ScheduleRule(from_=10, recipe="bf16"),
         r"precision.schedule\[1\]: from=10 until=null \(the end\) is the empty window \[10, 10\) "
         "of train.steps=10"),
        (ScheduleRule(from_=0.5, until=4, recipe="bf16"), r"empty window \[5, 4\)"),
    ],
)  # fmt: skip
def test_rules_that_match_nothing_or_never_apply_are_errors(rule, message):
    precision = PrecisionConfig(schedule=(ScheduleRule(recipe="nvfp4"), rule))
    with pytest.raises(ValueError, match=message):
        precision_phases(model_cfg(2), precision, 10)


def test_yaml_round_trip_spells_from_and_reads_ints_as_steps_floats_as_fractions(tmp_path):
    cfg = config_from_dict(
        {"precision": {"schedule": [{"from": 0.5, "until": 8, "gemms": ["wgrad"],
                                     "recipe": "mxfp4"}]}}
    )  # fmt: skip
    rule = cfg.precision.schedule[0]
    assert (rule.from_, rule.until, rule.gemms, rule.layers) == (0.5, 8, ("wgrad",), ".*")
    assert to_dict(cfg)["precision"]["schedule"] == [
        {"layers": ".*", "gemms": ["wgrad"], "from": 0.5, "until": 8, "recipe": "mxfp4"}
    ]
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_saved_configs_without_a_schedule_still_resume(tmp_path):
    cfg = config_from_dict({})
    saved = to_dict(cfg)
    del saved["precision"]["schedule"]
    check_same_model(cfg, saved, tmp_path)  # absent = [] = the same run
    check_same_model(cfg, to_dict(config_from_dict({"precision": {"schedule": []}})), tmp_path)
    scheduled = config_from_dict({"precision": {"schedule": THREE_PHASES_YAML[:1]}})
    with pytest.raises(ConfigError, match=r"precision\.schedule differ"):
        check_same_model(scheduled, saved, tmp_path)


# ----------------------------------------------------------------------------- sugar


@pytest.mark.parametrize(
    "precision",
    [
        {},
        {"recipe": "mxfp4", "bf16_first_layers": 2, "bf16_last_layers": 0},
        {"overrides": (r"layers\.[12]\.mlp\..*=fp8", r".*\.qkv=nvfp4-no-sr")},
        {"recipe": "bf16"},
        {"bf16_forward_from": 0.5},
        {"bf16_forward_from": 3, "overrides": (r"layers\.1\.attn\.o=bf16",)},
        {"bf16_forward_from": 0},
        {"bf16_forward_from": 1.0},  # switch at the end: only the final validation
        {"bf16_forward_from": 30},  # never
    ],
)
def test_without_a_schedule_the_phases_are_todays_recipes(precision):
    model, steps = model_cfg(6), 10
    config = PrecisionConfig(**precision)
    phases = precision_phases(model, config, steps)
    early = layer_recipes(model, config)
    late = layer_recipes(model, config, bf16_forward=True)
    switch = bf16_forward_start(config, steps)
    if switch is None or switch > steps or late == early:
        expected = [(0, early)]
    elif switch == 0:
        expected = [(0, late)]
    else:
        expected = [(0, early), (switch, late)]
    assert [(p.start, p.recipes) for p in phases] == expected
    for phase, (_, recipes) in zip(phases, expected, strict=True):
        for path, recipe in phase.recipes.items():
            assert recipe == recipes[path] and recipe.name == recipes[path].name
    assert export_recipe_names(model, config, steps) == layer_recipe_names(model, config)


def test_bf16_forward_from_equals_its_explicit_rule():
    model, rule = model_cfg(4), ScheduleRule(gemms=("fprop",), from_=0.5, recipe="bf16")
    sugar = precision_phases(model, PrecisionConfig(bf16_forward_from=0.5), 10)
    explicit = precision_phases(model, PrecisionConfig(schedule=(rule,)), 10)
    assert [(p.start, p.stop, p.recipes) for p in sugar] == [
        (p.start, p.stop, p.recipes) for p in explicit
    ]
    assert sugar[1].recipes["layers.1.mlp.down"] == NV.with_bf16_fprop()


def test_later_rules_win_and_each_gemm_composes():
    rules = (
        ScheduleRule(layers=r"layers\.1\..*", gemms=("dgrad", "wgrad"), recipe="mxfp4"),
        ScheduleRule(layers=r"layers\.1\.mlp\.down", gemms=("wgrad",), recipe="nvfp4-no-sr"),
        ScheduleRule(layers=r"layers\.2\..*", recipe="bf16", until=5),
    )
    (first, second) = precision_phases(model_cfg(4), quantized_everywhere(schedule=rules), 10)
    mx, no_sr = nvfp4_ops.get_recipe("mxfp4"), nvfp4_ops.get_recipe("nvfp4-no-sr")
    assert first.names["layers.1.attn.o"] == ("nvfp4", "mxfp4", "mxfp4")
    assert first.names["layers.1.mlp.down"] == ("nvfp4", "mxfp4", "nvfp4-no-sr")
    assert first.recipes["layers.1.mlp.down"] == compose(NV, mx, no_sr)
    assert first.recipes["layers.2.attn.qkv"] == BF16 and first.stop == 5
    assert second.recipes["layers.2.attn.qkv"] == NV and second.recipes["layers.0.attn.o"] == NV


def test_phases_merge_and_follow_completed_steps():
    schedule = (
        ScheduleRule(gemms=("fprop",), from_=2, until=4, recipe="bf16"),  # A, B, A
        ScheduleRule(layers=r"layers\.0\..*", from_=6, recipe="nvfp4"),  # changes nothing
    )
    phases = precision_phases(model_cfg(2), quantized_everywhere(schedule=schedule), 8)
    assert [p.label for p in phases] == ["[0, 2)", "[2, 4)", "[4, end)"]
    assert phases[0].key == phases[2].key != phases[1].key
    assert len({p.key for p in phases}) == 2
    assert [phase_index(phases, k) for k in range(9)] == [0, 0, 1, 1, 2, 2, 2, 2, 2]


def test_until_beyond_the_run_covers_the_final_validation():
    rule = ScheduleRule(gemms=("fprop",), from_=0.5, until=100, recipe="bf16")
    phases = precision_phases(model_cfg(2), quantized_everywhere(schedule=(rule,)), 8)
    assert [p.label for p in phases] == ["[0, 4)", "[4, end)"]
    assert phases[phase_index(phases, 8)].recipes["layers.0.mlp.down"] == NV.with_bf16_fprop()


def test_checkpoint_recipes_are_the_last_quantized_forward():
    model = model_cfg(2)
    names = export_recipe_names(model, quantized_everywhere(schedule=THREE_PHASES), 9)
    assert set(names.values()) == {"nvfp4"}
    late_mx = (ScheduleRule(layers=r"layers\.0\..*", gemms=("fprop",), from_=0.5, recipe="mxfp4"),)
    names = export_recipe_names(model, quantized_everywhere(schedule=late_mx), 9)
    assert names["layers.0.attn.qkv"] == "mxfp4" and names["layers.1.attn.qkv"] == "nvfp4"
    at_end = (
        ScheduleRule(layers=r"layers\.0\..*", gemms=("fprop",), from_=4, until=50, recipe="mxfp4"),
    )
    names = export_recipe_names(model, quantized_everywhere(schedule=at_end), 4)
    assert names["layers.0.attn.qkv"] == "nvfp4"  # its phase only validates the final model
    bf16_fprop = (ScheduleRule(gemms=("fprop",), recipe="bf16"),)
    names = export_recipe_names(model, quantized_everywhere(schedule=bf16_fprop), 9)
    assert set(names.values()) == {"nvfp4"}  # as bf16_forward_from=0: W quantized for Dgrad
    bf16_all = (ScheduleRule(layers=r"layers\.1\..*", recipe="bf16"),)
    names = export_recipe_names(model, quantized_everywhere(schedule=bf16_all), 9)
    assert names["layers.1.mlp.down"] == "bf16" and names["layers.0.mlp.down"] == "nvfp4"


def test_stacked_blocks_agree_in_every_phase():
    model = {"d_model": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 64}
    base = {
        "model": {**model, "scan_layers": True},
        "precision": {"bf16_first_layers": 0, "bf16_last_layers": 0},
        "train": {"steps": 9, "seq_len": 32},
    }
    keys = lambda cfg: [key for key, _, _ in run_layout(cfg).entries]  # noqa: E731
    assert keys(config_from_dict(base)) == ["0-3"]
    cfg = config_from_dict(base, [f"precision.schedule={json.dumps(THREE_PHASES_YAML)}"])
    assert keys(cfg) == ["0", "1", "2-3"]
    assert keys(config_from_dict(base, ["precision.bf16_forward_from=0.5"])) == ["0-3"]


# ----------------------------------------------------------------------------- show-config

SHOWN = """\
# precision schedule: the preset of each linear and GEMM per phase of completed steps
# (3 phases, 3 distinct: one compiled train step each)
#   linears           gemms        [0, 3)  [3, 6)  [6, end)
#   layers.0.*        fprop        nvfp4   bf16    bf16
#   layers.0.*        dgrad,wgrad  nvfp4   nvfp4   nvfp4
#   layers.1.*        fprop        nvfp4   bf16    bf16
#   layers.1.*        dgrad        nvfp4   nvfp4   nvfp4-no-sr
#   layers.1.*        wgrad        nvfp4   nvfp4   nvfp4
#   layers.2.*        fprop        nvfp4   bf16    bf16
#   layers.2.*        dgrad,wgrad  nvfp4   nvfp4   nvfp4
#   layers.3.*        *            bf16    bf16    bf16
"""


def test_show_config_prints_the_schedule_as_yaml_comments(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    model = {"d_model": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 64}
    mapping = {
        "model": model,
        "precision": {"bf16_first_layers": 0, "bf16_last_layers": 1, "schedule": THREE_PHASES_YAML},
        "train": {"steps": 9},
    }
    path.write_text(yaml.safe_dump(mapping))
    assert main(["show-config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.endswith(SHOWN)
    assert yaml.safe_load(printed)["precision"]["schedule"][1]["from"] == 6
    (tmp_path / "again.yaml").write_text(printed)
    assert load_config(tmp_path / "again.yaml") == config_from_dict(mapping)
    assert main(["show-config", str(path), "precision.schedule=[]", "model.num_layers=12"]) == 0
    assert capsys.readouterr().out.endswith(
        "# (1 phase, 1 distinct: one compiled train step each)\n"
        "#   linears           gemms  [0, end)\n"
        "#   layers.0-10.*     *      nvfp4\n"
        "#   layers.11.*       *      bf16\n"
    )
    bad = ["show-config", str(path), 'precision.schedule=[{layers: "x", recipe: bf16}]']
    assert main(bad) == 2
    assert "error: precision.schedule[0] (layers='x') matches no linear" in capsys.readouterr().err


# ----------------------------------------------------------------------------- runs


def _assert_same_params(a: Path, b: Path, step: int) -> None:
    jax.tree.map(np.testing.assert_array_equal, saved_params(a, step), saved_params(b, step))


KILL_STEPS = 9
KILL_SECTIONS = {
    "model": {"num_layers": 2},
    "precision": {
        "recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0,
        "schedule": THREE_PHASES_YAML,
    },
    "train": {"steps": KILL_STEPS, "log_every": 1, "eval_every": 3, "batch_size": 4,
              "seq_len": 16},
    "checkpoint": {"every_steps": 3, "keep": 4, "reference_sequences": 2},
    "logging": {"progress": "plain", "tensorboard": False},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KilledRun:
    reference: Path
    reference_output: str
    killed: Path
    resumed_output: str


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, tiny_config) -> KilledRun:
    """The three-phase schedule run uninterrupted, then SIGKILLed after step 4 (in phase 2,
    checkpoint 3 written), then resumed to the end. One after the other: under nox's persistent
    compilation cache the later runs load the reference's three compiled steps."""
    root = tmp_path_factory.mktemp("schedule-kill")
    configs = {}
    for name in ("reference", "killed"):
        configs[name] = root / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(tiny_config(root / name, **KILL_SECTIONS)))
    procs = {"reference": start_run(configs["reference"])}
    outs = {"reference": procs["reference"].communicate(timeout=900)}
    assert procs["reference"].returncode == 0, outs["reference"][1][-3000:]
    procs["killed"] = start_run(configs["killed"])
    try:
        deadline = time.monotonic() + 600
        while last_step(root / "killed") < 4:
            if procs["killed"].poll() is not None or time.monotonic() > deadline:
                out, err = procs["killed"].communicate()
                raise AssertionError(f"the run ended before step 4: {out[-1500:]}{err[-3000:]}")
            time.sleep(0.005)
        procs["killed"].send_signal(signal.SIGKILL)
        outs["killed"] = procs["killed"].communicate(timeout=900)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert procs["killed"].returncode == -signal.SIGKILL, "the kill came after the run's end"
    resumed = start_run(configs["killed"])
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    return KilledRun(root / "reference", outs["reference"][0], root / "killed", out)


def test_three_phases_compile_three_steps_and_announce_each(killed_run):
    out = killed_run.reference_output
    assert out.count("compiled the train step") == 3, out
    assert (
        "step 3: precision phase 2 of 3, completed steps [3, 6), starts: "
        "layers.0-1.* fprop nvfp4 -> bf16" in out
    )
    assert (
        "step 6: precision phase 3 of 3, completed steps [6, end), starts: "
        "layers.1.* dgrad nvfp4 -> nvfp4-no-sr" in out
    )


def test_sigkill_mid_schedule_resumes_bit_identically(killed_run):
    out = killed_run.resumed_output
    resumed_at = int(out.split("resumed from ")[1].split("(step ")[1].split(")")[0])
    assert resumed_at in (3, 6)  # checkpoints every 3 steps, killed after step 4
    assert f"step {resumed_at}: precision phase {resumed_at // 3 + 1} of 3" in out
    reference = train_losses(killed_run.reference)
    assert [s for s, _ in reference] == list(range(1, KILL_STEPS + 1))
    assert train_losses(killed_run.killed) == reference  # bit-identical floats, every step
    assert val_losses(killed_run.killed) == val_losses(killed_run.reference)
    _assert_same_params(killed_run.reference, killed_run.killed, KILL_STEPS)


def test_checkpoints_record_the_exported_forward(killed_run):
    step_dir = killed_run.killed / "checkpoints" / str(KILL_STEPS)
    stats = json.loads((step_dir / "quant_stats" / "metadata").read_text())
    paths = linear_paths(model_cfg(2))
    assert stats["recipes"] == dict.fromkeys(paths, "nvfp4")
    assert sorted(stats["activation_amax"]) == sorted(paths)
    assert (step_dir / "reference").is_dir()


def test_a_b_a_compiles_two_train_steps_and_says_which_phase_starts(
    killed_run, tiny_config, tmp_path
):
    """The fixture's model and steps with an A, B, A schedule: its two programs are the fixture's
    first two phases, which nox's compilation cache has by now (requested for that order)."""
    rule = {"gemms": ["fprop"], "from": 2, "until": 4, "recipe": "bf16"}
    mapping = tiny_config(tmp_path / "aba", **KILL_SECTIONS)
    mapping["precision"] = {**mapping["precision"], "schedule": [rule]}
    out = io.StringIO()
    run(config_from_dict(mapping), stream=out)
    out = out.getvalue()
    assert out.count("compiled the train step") == 2, out
    assert (
        "step 2: precision phase 2 of 3, completed steps [2, 4), starts: "
        "layers.0-1.* fprop nvfp4 -> bf16" in out
    )
    assert (
        "step 4: precision phase 3 of 3, completed steps [4, end), starts: "
        "layers.0-1.* fprop bf16 -> nvfp4" in out
    )
    assert sorted(val_losses(tmp_path / "aba")) == [3, 6, 9]  # in phases 2, 3 and 3
