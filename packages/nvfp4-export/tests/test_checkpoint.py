"""Reading checkpoints through the on-disk schema; the precision rule; bad input."""

import shutil

import numpy as np
import pytest
from conftest import model_config, write_run

from nvfp4_export import ExportError, read_checkpoint, resolve_checkpoint, spec_from_config
from nvfp4_export.policy import default_bf16_layers, linear_recipes


def test_resolve_run_dir_picks_newest_step_and_step_option(tiny_run):
    assert resolve_checkpoint(tiny_run).step == 4
    assert resolve_checkpoint(tiny_run, step=2).step == 2
    assert resolve_checkpoint(tiny_run / "checkpoints").step == 4
    ref = resolve_checkpoint(tiny_run / "checkpoints" / "2")
    assert (ref.step, ref.run_dir) == (2, tiny_run)


def test_resolve_errors_name_the_problem(tiny_run, tmp_path):
    with pytest.raises(ExportError, match=r"no checkpoint at step 3 .*have steps \[2, 4\]"):
        resolve_checkpoint(tiny_run, step=3)
    with pytest.raises(ExportError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(ExportError, match="no checkpoint under"):
        resolve_checkpoint(tmp_path)


def test_read_checkpoint_gives_the_params_tree_and_config(tiny_run):
    ckpt = read_checkpoint(resolve_checkpoint(tiny_run))
    assert ckpt.params["layers.1.attn.qkv.kernel"].shape == (64, 128)
    assert ckpt.params["lm_head.kernel"].dtype == np.float32
    assert ckpt.config["model"]["d_model"] == 64
    assert sorted(ckpt.quant_stats) == ["activation_amax"] and ckpt.reference is None
    assert ckpt.tokenizer_dir == tiny_run / "tokenizer"
    spec = spec_from_config(ckpt.config, ckpt.params)
    assert (spec.vocab_size, spec.head_dim, spec.qkv_split) == (257, 16, (64, 32, 32))


def test_corrupt_params_is_a_clear_error(tmp_path):
    run = write_run(tmp_path / "run")
    params = run / "checkpoints" / "2" / "params"
    for child in params.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
    with pytest.raises(ExportError, match="cannot be read"):
        read_checkpoint(resolve_checkpoint(run))


def test_dimensions_not_multiple_of_16_are_refused(tmp_path):
    run = write_run(tmp_path / "run", model=model_config(d_model=72, num_heads=4, mlp_dim=96))
    ckpt = read_checkpoint(resolve_checkpoint(run))
    with pytest.raises(ExportError, match="d_model must be a multiple of 16.*got 72"):
        spec_from_config(ckpt.config, ckpt.params)


def test_params_that_do_not_match_the_config_are_refused(tiny_run):
    ckpt = read_checkpoint(resolve_checkpoint(tiny_run))
    config = {**ckpt.config, "model": {**ckpt.config["model"], "num_layers": 5}}
    with pytest.raises(ExportError, match="missing"):
        spec_from_config(config, ckpt.params)


def test_a_mixture_of_experts_checkpoint_is_refused_by_name(tiny_run):
    ckpt = read_checkpoint(resolve_checkpoint(tiny_run))
    moe = {"num_experts": 8, "experts_per_token": 2, "expert_mlp_dim": 64}
    config = {**ckpt.config, "model": {**ckpt.config["model"], "moe": moe}}
    with pytest.raises(ExportError, match=r"Mixture-of-Experts model \(model.moe.num_experts=8\)"):
        spec_from_config(config, ckpt.params)


def test_default_rule_matches_the_documented_examples():
    got = [default_bf16_layers(n) for n in (1, 2, 4, 6, 12, 32, 62, 126)]
    assert got == [(0, 0), (0, 1), (1, 1), (1, 1), (1, 2), (1, 4), (2, 8), (2, 8)]


def test_recipes_from_config_rule_overrides_and_quant_stats(tiny_run):
    ckpt = read_checkpoint(resolve_checkpoint(tiny_run))
    spec = spec_from_config(ckpt.config, ckpt.params)
    rule = linear_recipes(spec, ckpt.config, None)
    assert rule["layers.0.attn.qkv"] == "bf16" and rule["layers.3.mlp.down"] == "bf16"
    assert rule["layers.1.attn.o"] == "nvfp4" and rule["layers.2.mlp.gate_up"] == "nvfp4"
    config = {"precision": {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0,
                            "overrides": [r"layers\.2\.mlp\..*=bf16"]}}  # fmt: skip
    over = linear_recipes(spec, config, None)
    assert over["layers.0.attn.qkv"] == "nvfp4" and over["layers.2.mlp.down"] == "bf16"
    listed = dict.fromkeys(spec.linear_paths(), "nvfp4-no-2d")
    assert linear_recipes(spec, ckpt.config, {"recipes": listed}) == listed
    with pytest.raises(ExportError, match="missing"):
        linear_recipes(spec, ckpt.config, {"recipes": {"layers.0.attn.qkv": "bf16"}})
