"""Mixture-of-Experts exports: names and config per class, every expert's input scale from its
training amax (idle experts: the block's largest, warned), refusals that name the expert, mixed
expert precision refused, byte-identical sharded reruns, and verify catching broken expert
scales. The serving rules themselves are test_moe_serving_rules.py."""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    MOE_CASES,
    SMALL_MODEL,
    add_pytree_item,
    model_config,
    set_scalar_and_reseal,
    trained_stats,
    write_run,
)

from nvfp4_export import (
    ExportError,
    export_hf,
    forward,
    load_export,
    read_checkpoint,
    resolve_checkpoint,
    spec_from_config,
)
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import weights_from_checkpoint
from nvfp4_export.verify import MOE_ROUTING_NOTE, render, verify

ALL_FP4 = {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0}


def _model(case: str) -> dict:
    return model_config(**SMALL_MODEL, **MOE_CASES[case])


def _run(tmp_path, case="qwen3_moe", *, precision=None, stats="trained", amax=None):
    model = _model(case)
    quant_stats = trained_stats(model) if stats == "trained" else stats
    if amax:
        quant_stats = {"activation_amax": {**quant_stats["activation_amax"], **amax}}
    return write_run(tmp_path / "run", model=model, precision=precision or ALL_FP4,
                     quant_stats=quant_stats)  # fmt: skip


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_names_config_and_router_per_class(moe_runs, case, tmp_path):
    out = export_hf(moe_runs[case], tmp_path / "mo", layout="modelopt").out_dir
    config = json.loads((out / "config.json").read_text())
    loaded = load_export(out)
    block = "block_sparse_moe" if case == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if case == "mixtral" else ("gate_proj", "up_proj",
                                                                   "down_proj")  # fmt: skip
    assert config["architectures"] == [{"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral":
                                        "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[case]]  # fmt: skip
    experts_key = "num_local_experts" if case == "mixtral" else "num_experts"
    assert config[experts_key] == 4 and config["num_experts_per_tok"] == 2
    assert config.get("moe_intermediate_size", config.get("intermediate_size")) == 32
    for e in range(4):  # block 0 NVFP4: every expert's codes, block 1 BF16: every expert's weight
        for p in (gate, up, down):
            assert (
                loaded.tensors[f"model.layers.0.{block}.experts.{e}.{p}.weight"].dtype == np.uint8
            )
            assert loaded.tensors[f"model.layers.1.{block}.experts.{e}.{p}.weight"].dtype.name == (
                "bfloat16"
            )
    params = read_checkpoint(resolve_checkpoint(moe_runs[case])).params
    router = loaded.tensors[f"model.layers.0.{block}.gate.weight"]
    expected = params["layers.0.mlp.router.kernel"].T.astype(ml_dtypes.bfloat16)
    assert router.tobytes() == np.ascontiguousarray(expected).tobytes()
    if case == "qwen2_moe":
        assert config["shared_expert_intermediate_size"] == 48
        assert loaded.tensors["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 32)
        assert loaded.tensors["model.layers.1.mlp.shared_expert.up_proj.weight"].shape == (48, 32)


def test_an_idle_expert_gets_its_blocks_largest_amax_and_a_warning(tmp_path):
    stats = trained_stats(_model("qwen3_moe"))["activation_amax"]
    gate_up = list(stats["layers.0.mlp.experts.gate_up"])
    gate_up[2] = 0.0
    run = _run(tmp_path, amax={"layers.0.mlp.experts.gate_up": gate_up})
    lines: list[str] = []
    result = export_hf(run, tmp_path / "mo", layout="modelopt", log=lines.append)
    note = [n for n in result.notes if "experts [2]" in n]
    assert len(note) == 1 and "layers.0.mlp.experts.gate_up" in note[0]
    assert any(
        line.startswith("warning: layers.0.mlp.experts.gate_up: experts [2]") for line in lines
    )
    t = load_export(result.out_dir).tensors
    got = t["model.layers.0.mlp.experts.2.gate_proj.input_scale"]
    assert got == np.float32(max(gate_up)) / np.float32(6 * 448) and got > 0
    assert t["model.layers.0.mlp.experts.2.up_proj.input_scale"] == got
    assert verify(result.out_dir, against=run).problems == ()


@pytest.mark.parametrize("bad, fragment", [
    ([0.0, 0.0, 0.0, 0.0], "every expert (0, 1, 2, 3) has input amax 0"),
    (3.5, "is not a list of 4 finite numbers"),
    ([1.0, 2.0], "is not a list of 4 finite numbers"),
])  # fmt: skip
def test_a_block_without_amax_is_refused_naming_it(tmp_path, bad, fragment):
    run = _run(tmp_path, amax={"layers.1.mlp.experts.down": bad})
    with pytest.raises(ExportError, match=re.escape(fragment)) as info:
        export_hf(run, tmp_path / "mo", layout="modelopt")
    assert "layers.1.mlp.experts.down" in str(info.value)
    assert "--allow-uncalibrated-experts" in str(info.value)
    assert not (tmp_path / "mo").exists()
    # allowed: the model's largest amax of that projection (block 0's), warned
    result = export_hf(run, tmp_path / "mo", layout="modelopt", allow_uncalibrated_experts=True)
    block0 = max(trained_stats(_model("qwen3_moe"))["activation_amax"]["layers.0.mlp.experts.down"])
    scale = load_export(result.out_dir).tensors[
        "model.layers.1.mlp.experts.3.down_proj.input_scale"
    ]
    assert scale == np.float32(block0) / np.float32(6 * 448)
    assert any("--allow-uncalibrated-experts" in n for n in result.notes)


def test_no_amax_anywhere_is_refused_even_when_allowed(tmp_path):
    zero = [0.0] * 4
    run = _run(tmp_path, amax={f"layers.{i}.mlp.experts.{k}": zero for i in (0, 1)
                               for k in ("gate_up", "down")})  # fmt: skip
    with pytest.raises(ExportError, match="no other MoE block has an input amax"):
        export_hf(
            run, tmp_path / "ct", layout="compressed-tensors", allow_uncalibrated_experts=True
        )
    # weight-only needs no input scale at all
    assert export_hf(run, tmp_path / "wo", layout="modelopt", weight_only=True).plan.w4a4 is False


def test_experts_of_one_block_in_two_precisions_are_refused(tmp_path):
    precision = {**ALL_FP4, "overrides": [r"layers\.0\.mlp\.experts\.down=bf16"]}
    run = _run(tmp_path, precision=precision)
    with pytest.raises(ExportError, match="layer 0's experts mix BF16 and FP4"):
        export_hf(run, tmp_path / "mo", layout="modelopt")


def test_an_moe_model_of_a_dense_class_is_refused(tmp_path):
    model = model_config(**SMALL_MODEL, moe=MOE_CASES["mixtral"]["moe"])  # architecture llama
    run = write_run(tmp_path / "run", model=model, quant_stats=None)
    with pytest.raises(ExportError, match="no Hugging Face MoE class"):
        export_hf(run, tmp_path / "mo", layout="modelopt", weight_only=True)
    model = model_config(**SMALL_MODEL, **{**MOE_CASES["qwen2_moe"], "moe": {
        **MOE_CASES["qwen2_moe"]["moe"], "shared_expert_gate": False}})  # fmt: skip
    run = write_run(tmp_path / "run2", model=model, quant_stats=None)
    with pytest.raises(ExportError, match=r"builds model.moe.shared_expert_gate in \(True,\)"):
        export_hf(run, tmp_path / "mo2", layout="modelopt", weight_only=True)


def test_moe_exports_stream_into_shards_byte_identically(tmp_path):
    run = _run(tmp_path, case="qwen2_moe")
    first = export_hf(run, tmp_path / "a", layout="compressed-tensors", max_shard_bytes=20_000)
    second = export_hf(run, tmp_path / "b", layout="compressed-tensors", max_shard_bytes=20_000)
    names = sorted(p.name for p in first.out_dir.iterdir())
    assert "model.safetensors.index.json" in names and len(first.files) > 6
    assert names == sorted(p.name for p in second.out_dir.iterdir())
    for name in names:
        assert (first.out_dir / name).read_bytes() == (second.out_dir / name).read_bytes(), name
    report = verify(first.out_dir, against=run)
    assert report.ok and report.complete, report.problems


def _rewrite(path, changes: dict) -> None:
    from safetensors.numpy import save_file

    from nvfp4_format.safetensors_file import load_safetensors

    tensors = dict(load_safetensors(path)[0])
    tensors.update(changes)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_verify_catches_unequal_and_zero_expert_scales(moe_runs, tmp_path):
    out = export_hf(moe_runs["mixtral"], tmp_path / "mo", layout="modelopt").out_dir
    base = "model.layers.0.block_sparse_moe.experts"
    _rewrite(out / "model.safetensors", {
        f"{base}.1.w3.weight_scale_2": np.array(1e-3, np.float32),
        f"{base}.2.w2.input_scale": np.array(0.0, np.float32),
    })  # fmt: skip
    problems = " | ".join(verify(out).problems)
    assert "layer 0 expert 1: weight_scale_2 of" in problems and "differ" in problems
    assert "layer 0 expert 2: a zero input_scale" in problems
    assert f"{base}.1.w3.weight_scale_2" not in problems or "differs from" in problems


@pytest.mark.parametrize(
    ("layout", "suffix"),
    [("modelopt", "input_scale"), ("compressed-tensors", "input_global_scale")],
)
def test_verify_compares_every_expert_input_scale_with_the_runs_amax(
    moe_runs, tmp_path, layout, suffix
):
    out = export_hf(moe_runs["mixtral"], tmp_path / "out", layout=layout).out_dir
    tensor = f"model.layers.0.block_sparse_moe.experts.2.w2.{suffix}"
    set_scalar_and_reseal(out, tensor, 1e6)  # the checksums agree, as after an export bug
    report = verify(out, against=moe_runs["mixtral"])
    (problem,) = [p for p in report.problems if p.startswith(tensor)]
    assert f"{tensor} is 1000000, expected " in problem and "quant_stats" in problem


def test_moe_emulation_vs_the_jax_forward_is_informational(tmp_path):
    run = _run(tmp_path)
    ckpt = read_checkpoint(resolve_checkpoint(run))
    spec = spec_from_config(ckpt.config, ckpt.params)
    weights = weights_from_checkpoint(ckpt, spec, linear_recipes(spec, ckpt.config, None), {})
    tokens = np.random.default_rng(3).integers(0, 257, size=(3, 16)).astype(np.int32)
    logits = forward(weights, tokens)[::-1].copy()  # as if routing ties flipped every expert
    add_pytree_item(run / "checkpoints" / "2", "reference", {"tokens": tokens, "logits": logits})
    report = verify(export_hf(run, tmp_path / "mo", layout="modelopt").out_dir, against=run)
    first = report.comparisons[0]
    assert first.passed is None and first.top1 < 0.9 and report.ok, report
    assert first.note == MOE_ROUTING_NOTE and "the run's JAX forward" in first.against
    assert f"[info: {MOE_ROUTING_NOTE}]" in render(report)


def test_onnx_export_of_moe_is_refused(moe_runs, tmp_path):
    from nvfp4_export import export_onnx

    with pytest.raises(ExportError, match="ONNX export of Mixture-of-Experts models"):
        export_onnx(moe_runs["qwen3_moe"], tmp_path / "m.onnx")
