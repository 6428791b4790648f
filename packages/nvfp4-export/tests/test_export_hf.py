"""`export_hf`: both layouts, their invariants, W4A4 scales, atomic output, sharding."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import add_pytree_item, write_run

import nvfp4_format
from nvfp4_export import ExportError, export_hf, load_export
from nvfp4_export.checkpoint import QUANT_STATS_ITEM
from nvfp4_export.invariants import layout_problems
from nvfp4_format.cli import inspect_checkpoint

Q = "model.layers.1.self_attn.q_proj"


@pytest.fixture(scope="module")
def exports(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    return {
        layout: export_hf(tiny_run, out / layout, layout=layout).out_dir
        for layout in ("modelopt", "compressed-tensors")
    }


def test_layouts_hold_identical_bytes_and_reciprocal_global_scales(exports):
    mo = load_export(exports["modelopt"]).tensors
    ct = load_export(exports["compressed-tensors"]).tensors
    for i in (1, 2):
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{m}"
            assert mo[name + ".weight"].tobytes() == ct[name + ".weight_packed"].tobytes()
            assert mo[name + ".weight_scale"].tobytes() == ct[name + ".weight_scale"].tobytes()
            dec, enc = mo[name + ".weight_scale_2"], ct[name + ".weight_global_scale"]
            assert dec.shape == () and enc.shape == (1,)
            assert dec == np.float32(1.0) / enc[0]
    assert mo["model.layers.0.self_attn.q_proj.weight"].dtype.name == "bfloat16"


def test_invariants_metadata_and_exclusions(exports):
    for path in exports.values():
        loaded = load_export(path)
        assert layout_problems(loaded) == []
        assert loaded.provenance["w4a4"]  # training's activation amaxes give the input scales
    hq = json.loads((exports["modelopt"] / "hf_quant_config.json").read_text())
    q = hq["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
    excluded = q["exclude_modules"]
    assert excluded[0] == "lm_head" and "model.layers.0.mlp.down_proj" in excluded
    assert "model.layers.1.mlp.down_proj" not in excluded
    # the fully BF16 blocks 0 and 3 are also listed by the fused names servers build
    for i in (0, 3):
        assert f"model.layers.{i}.self_attn.qkv_proj" in excluded
        assert f"model.layers.{i}.mlp.gate_up_proj" in excluded
    assert not [m for m in excluded if "*" in m or "layers.1." in m or "layers.2." in m]
    cfg = json.loads((exports["modelopt"] / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == excluded
    cfg = json.loads((exports["compressed-tensors"] / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    # the same list: transformers matches q/k/v by name, TensorRT-LLM and SGLang the fused names
    assert qc["ignore"] == excluded
    assert "scale_dtype" not in json.dumps(qc)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["eos_token_id"] == 256
    assert (exports["compressed-tensors"] / "tokenizer.json").is_file()


def test_weight_only_modelopt_must_be_asked_for(tmp_path, capsys):
    run = write_run(tmp_path / "run", quant_stats=None)  # a checkpoint without statistics
    with pytest.raises(ExportError, match=r"Pass --calibrate N .* or --weight-only"):
        export_hf(run, tmp_path / "mo", layout="modelopt")
    assert not (tmp_path / "mo").exists()
    asked = export_hf(run, tmp_path / "mo", layout="modelopt", weight_only=True)
    quant = json.loads((asked.out_dir / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4"
    said = []
    ct = export_hf(run, tmp_path / "ct", layout="compressed-tensors", log=said.append)
    assert not ct.plan.w4a4 and any(s.startswith("warning: ") and "WEIGHT-ONLY" in s for s in said)


def test_a_broken_invariant_is_reported(exports, tmp_path):
    loaded = load_export(exports["modelopt"])
    tensors = dict(loaded.tensors)
    tensors["model.layers.1.self_attn.k_proj.weight_scale_2"] = np.float32(1.0) * np.ones(
        (), np.float32
    )
    broken = type(loaded)(
        loaded.path, loaded.config, loaded.provenance, loaded.hf_quant_config, tensors, loaded.files
    )
    assert any("not shared" in p for p in layout_problems(broken))


def test_nvfp4_format_inspect_reads_the_exports(exports):
    for layout, path in exports.items():
        report = inspect_checkpoint(path)
        assert len(report.quantized) == 14, layout  # 2 quantized blocks x 7 modules
        assert not any(q.problems for q in report.quantized)


def test_w4a4_from_quant_stats_writes_shared_input_scales(tmp_path):
    paths = [
        f"layers.{i}.{n}"
        for i in range(4)
        for n in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    ]
    stats = {"activation_amax": {p: 2.0 + k for k, p in enumerate(paths)}}
    run = write_run(tmp_path / "run", quant_stats=stats)
    mo = export_hf(run, tmp_path / "mo", layout="modelopt")
    ct = export_hf(run, tmp_path / "ct", layout="compressed-tensors")
    assert mo.plan.w4a4 and mo.amax_source == QUANT_STATS_ITEM
    a, b = load_export(mo.out_dir).tensors, load_export(ct.out_dir).tensors
    amax = stats["activation_amax"]["layers.1.attn.qkv"]
    for m in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{m}"
        assert a[name + ".input_scale"] == nvfp4_format.global_decode_scale(np.float32(amax))
        assert b[name + ".input_global_scale"][0] == nvfp4_format.global_encode_scale(
            np.float32(amax)
        )
    assert (
        json.loads((mo.out_dir / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
        == "NVFP4"
    )
    assert layout_problems(load_export(ct.out_dir)) == []
    weight_only = export_hf(run, tmp_path / "wo", layout="modelopt", weight_only=True)
    assert (
        not weight_only.plan.w4a4
        and "model.layers.1.self_attn.q_proj.input_scale"
        not in load_export(weight_only.out_dir).tensors
    )


def test_calibration_from_reference_tokens(tmp_path):
    run = write_run(tmp_path / "run")
    tokens = np.random.default_rng(1).integers(0, 257, size=(3, 16)).astype(np.int32)
    add_pytree_item(
        run / "checkpoints" / "2",
        "reference",
        {"tokens": tokens, "logits": np.zeros((3, 16, 257), np.float32)},
    )
    result = export_hf(run, tmp_path / "out", layout="compressed-tensors", calibrate_n=2)
    assert result.plan.w4a4 and result.amax_source == "calibration"
    amax = load_export(result.out_dir).provenance["input_amax"]
    assert set(amax) == {
        f"layers.{i}.{n}"
        for i in range(4)
        for n in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    }
    assert all(v > 0 for v in amax.values())


def test_calibration_without_sequences_is_a_clear_error(tiny_run, tmp_path):
    with pytest.raises(ExportError, match="--calibrate needs sequences"):
        export_hf(tiny_run, tmp_path / "out", layout="modelopt", calibrate_n=2)
    assert not (tmp_path / "out").exists()


def test_existing_output_refused_unless_overwrite(tiny_run, tmp_path):
    out = tmp_path / "out"
    export_hf(tiny_run, out, layout="modelopt")
    (out / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="already exists"):
        export_hf(tiny_run, out, layout="modelopt")
    assert (out / "keep.txt").is_file()
    export_hf(tiny_run, out, layout="modelopt", overwrite=True)  # a previous export: replaced
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_export_leaves_nothing(tiny_run, tmp_path, monkeypatch):
    import nvfp4_export.hf_export as hf_export

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export.ShardWriter, "write", boom)  # fails mid-stream
    with pytest.raises(ExportError, match="cannot write output .*disk full"):
        export_hf(tiny_run, tmp_path / "out", layout="compressed-tensors")
    assert list(tmp_path.iterdir()) == []


def test_unknown_layout(tiny_run, tmp_path):
    with pytest.raises(ExportError, match="layout must be one of"):
        export_hf(tiny_run, tmp_path / "out", layout="gguf")


def test_sharded_output_has_an_index(tiny_run, tmp_path):
    result = export_hf(
        tiny_run, tmp_path / "out", layout="compressed-tensors", max_shard_bytes=60_000
    )
    index = json.loads((result.out_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    assert index["metadata"]["total_size"] == sum(
        a.nbytes for a in load_export(result.out_dir).tensors.values()
    )
    assert layout_problems(load_export(result.out_dir)) == []
    assert len(inspect_checkpoint(result.out_dir).quantized) == 14


def test_mxfp4_run_exports_mxfp4_pack_quantized(tmp_path):
    run = write_run(tmp_path / "run", precision={"recipe": "mxfp4"})
    result = export_hf(run, tmp_path / "ct", layout="compressed-tensors")
    loaded = load_export(result.out_dir)
    assert result.plan.fmt == "mxfp4" and layout_problems(loaded) == []
    qc = loaded.config["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert loaded.tensors[Q + ".weight_scale"].dtype == np.uint8
    with pytest.raises(ExportError, match="MXFP4"):
        export_hf(run, tmp_path / "mo", layout="modelopt")
    assert not Path(tmp_path / "mo").exists()


def test_per_token_runs_export_weight_only_never_w4a4(tmp_path):
    """Per-token activation scales have no NVFP4 W4A4 layout: refused, --weight-only works."""
    run = write_run(tmp_path / "run", precision={"recipe": "nvfp4-per-token"})
    for layout in ("modelopt", "compressed-tensors"):
        with pytest.raises(ExportError, match=r"one outer scale per token.*--weight-only"):
            export_hf(run, tmp_path / layout, layout=layout)
        assert not (tmp_path / layout).exists()
    done = export_hf(run, tmp_path / "wo", layout="compressed-tensors", weight_only=True)
    assert not done.plan.w4a4
    assert layout_problems(load_export(done.out_dir)) == []


@pytest.mark.parametrize("recipe", ["nvfp4-4over6", "nvfp4-fwd-mxfp8-bwd"])
def test_recipe_variants_export_standard_nvfp4_w4a4(tmp_path, recipe):
    """Four Over Six and the MXFP8 backward leave the forward weights standard NVFP4 (16x16)."""
    run = write_run(tmp_path / "run", precision={"recipe": recipe})
    done = export_hf(run, tmp_path / "ct", layout="compressed-tensors")
    assert done.plan.w4a4 and done.plan.fmt == "nvfp4"
    got = load_export(done.out_dir)
    assert layout_problems(got) == []
    standard = write_run(tmp_path / "std", precision={"recipe": "nvfp4"})  # same weights
    want = load_export(
        export_hf(standard, tmp_path / "ct-std", layout="compressed-tensors").out_dir
    )
    name = Q + ".weight_global_scale"
    if recipe == "nvfp4-4over6":  # amax / (6 * 256) instead of amax / (6 * 448), 4/6 blocks
        np.testing.assert_allclose(want.tensors[name] / got.tensors[name], 448 / 256, rtol=1e-6)
        assert (
            got.tensors[Q + ".weight_packed"].tobytes()
            != want.tensors[Q + ".weight_packed"].tobytes()
        )
    else:  # the forward weights are the full recipe's
        for suffix in (".weight_global_scale", ".weight_packed", ".weight_scale"):
            assert got.tensors[Q + suffix].tobytes() == want.tensors[Q + suffix].tobytes()


def test_a_scheduled_run_without_its_recipe_map_is_refused(tmp_path):
    """A precision schedule is not re-derived from the config: the checkpoint's map is needed."""
    precision = {"recipe": "nvfp4", "schedule": [{"gemms": ["fprop"], "from": 2, "recipe": "bf16"}]}
    run = write_run(tmp_path / "run", precision=precision, quant_stats=None)
    with pytest.raises(ExportError, match=r"precision.schedule \(1 rules\).*quant_stats.recipes"):
        export_hf(run, tmp_path / "ct", layout="compressed-tensors")
    assert not (tmp_path / "ct").exists()
    stats = {"recipes": {p: "nvfp4" for p in _linear_paths(4)}}
    listed = write_run(tmp_path / "listed", precision=precision, quant_stats=stats)
    done = export_hf(listed, tmp_path / "ct", layout="compressed-tensors", weight_only=True)
    assert done.plan.fmt == "nvfp4"


def _linear_paths(num_layers: int) -> list[str]:
    names = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    return [f"layers.{i}.{n}" for i in range(num_layers) for n in names]
