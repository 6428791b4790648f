"""`nvfp4-format inspect` end to end on checkpoints written by `safetensors`."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import nvfp4_format as nf
from nvfp4_format.checkpoint_report import _layout_warning, declared_layouts, inspect_checkpoint
from nvfp4_format.cli import main

HIDDEN, FFN = 32, 64
LINEARS = {  # name -> (out, in)
    "model.layers.0.self_attn.q_proj": (HIDDEN, HIDDEN),
    "model.layers.0.mlp.up_proj": (FFN, HIDDEN),
    "model.layers.0.mlp.down_proj": (HIDDEN, FFN),
}
HF_QUANT_CONFIG = {
    "producer": {"name": "test", "version": "0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    },
}
CT_CONFIG = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized"}},
    }
}


def _quantized(seed: int) -> dict[str, nf.NVFP4Array]:
    rng = np.random.default_rng(seed)
    return {m: nf.quantize(rng.standard_normal(s).astype(np.float32)) for m, s in LINEARS.items()}


def _plain(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((50, HIDDEN)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": np.ones(HIDDEN, np.float32),
    }


def _modelopt_tensors(quantized) -> dict[str, np.ndarray]:
    tensors = {}
    for m, q in quantized.items():
        tensors[f"{m}.weight"] = np.asarray(q.packed)
        tensors[f"{m}.weight_scale"] = np.asarray(q.block_scales)
        tensors[f"{m}.weight_scale_2"] = np.asarray(q.global_scale, np.float32)
    return tensors


def _ct_tensors(quantized) -> dict[str, np.ndarray]:
    tensors = {}
    for m, q in quantized.items():
        tensors[f"{m}.weight_packed"] = np.asarray(q.packed)
        tensors[f"{m}.weight_scale"] = np.asarray(q.block_scales)
        tensors[f"{m}.weight_global_scale"] = 1 / np.asarray(q.global_scale, np.float32).reshape(1)
    return tensors


@pytest.fixture
def modelopt_dir(tmp_path):
    quantized = _quantized(0)
    tensors = _modelopt_tensors(quantized) | _plain(1)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    return tmp_path, quantized, tensors


def _run_json(capsys, *args) -> tuple[int, dict]:
    code = main(["inspect", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_report_of_a_modelopt_checkpoint(modelopt_dir, capsys):
    directory, quantized, tensors = modelopt_dir
    code, doc = _run_json(capsys, directory / "model.safetensors")
    assert code == 0
    assert doc["format_version"] == 1
    (ckpt,) = doc["checkpoints"]
    assert ckpt["declared_layouts"] == ["modelopt-nvfp4"]
    assert ckpt["declared_sources"] == ["hf_quant_config.json"]
    assert ckpt["found_layouts"] == ["modelopt-nvfp4"]
    assert ckpt["warnings"] == []
    by_module = {q["module"]: q for q in ckpt["quantized"]}
    assert sorted(by_module) == sorted(LINEARS)
    for m, (out, inp) in LINEARS.items():
        got, q = by_module[m], quantized[m]
        codes = nf.unpack_fp4(q.packed)
        assert got["shape"] == [out, inp]
        assert got["codes"]["saturated_fraction"] == np.isin(codes, (7, 15)).mean()
        assert got["codes"]["zero_fraction"] == np.isin(codes, (0, 8)).mean()
        assert got["block_scales"]["max"] == 448.0
        assert got["global_decode_scale"] == pytest.approx(float(q.global_scale), rel=1e-7)
        assert got["bits_per_element"] == 8 * (out * inp * 9 // 16 + 4) / (out * inp)
        assert got["problems"] == []
    plain = {u["name"]: u for u in ckpt["unquantized"]}
    assert plain["model.norm.weight"] == {
        "name": "model.norm.weight",
        "dtype": "F32",
        "shape": [HIDDEN],
        "nbytes": 4 * HIDDEN,
    }
    totals = ckpt["totals"]
    quantized_params = sum(o * i for o, i in LINEARS.values())
    plain_params = 50 * HIDDEN + HIDDEN
    assert totals["quantized_params"] == quantized_params
    assert totals["total_params"] == quantized_params + plain_params
    assert totals["tensor_bytes"] == sum(t.nbytes for t in tensors.values())
    assert totals["bf16_bytes"] == 2 * (quantized_params + plain_params)
    assert totals["size_ratio_vs_bf16"] == totals["tensor_bytes"] / totals["bf16_bytes"]
    assert totals["file_bytes"] == os.path.getsize(directory / "model.safetensors")


def test_text_report_is_an_aligned_table(modelopt_dir, capsys):
    directory, _, _ = modelopt_dir
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "declared layout: modelopt-nvfp4 (from hf_quant_config.json)" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("module "))
    rows = lines[header : header + 2 + len(LINEARS)]
    assert set(rows[1]) <= {"-", " "}
    # right-aligned numeric columns end at the same offset on every row
    assert len({len(r) for r in rows}) == 1
    for m in LINEARS:
        assert any(r.startswith(m) and "modelopt-nvfp4" in r for r in rows)
    assert "model.embed_tokens.weight" in out and "BF16" in out
    assert "PROBLEM" not in out and "WARNING" not in out


def test_compressed_tensors_with_a_mismatched_declaration(tmp_path, capsys):
    save_file(_ct_tensors(_quantized(2)), str(tmp_path / "model.safetensors"))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    code, doc = _run_json(capsys, tmp_path)
    (ckpt,) = doc["checkpoints"]
    assert code == 0
    assert ckpt["found_layouts"] == ["compressed-tensors-nvfp4"]
    assert len(ckpt["warnings"]) == 1
    assert "declares ['modelopt-nvfp4']" in ckpt["warnings"][0]
    (tmp_path / "hf_quant_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(CT_CONFIG))
    assert inspect_checkpoint(tmp_path).warnings == ()


@pytest.mark.parametrize(
    ("declared", "found", "warns"),
    [
        ((), ("modelopt-nvfp4",), False),  # nothing declared: nothing to compare
        (("modelopt-nvfp4", "modelopt:FP8"), ("modelopt-nvfp4",), False),  # mixed precision
        (("fp8",), (), False),
        (("fp8",), ("modelopt-nvfp4",), True),
        (("modelopt-nvfp4",), (), True),
        (("compressed-tensors-mxfp4",), ("compressed-tensors-nvfp4",), True),
    ],
)
def test_layout_warning_compares_the_fp4_part(declared, found, warns):
    assert bool(_layout_warning(declared, found)) == warns


def test_declared_layouts_from_config_files():
    assert declared_layouts(HF_QUANT_CONFIG, None) == ("modelopt-nvfp4",)
    assert declared_layouts(None, CT_CONFIG) == ("compressed-tensors-nvfp4",)
    mx = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
        }
    }
    assert declared_layouts(None, mx) == ("compressed-tensors-mxfp4",)
    modelopt = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}}
    assert declared_layouts(None, modelopt) == ("modelopt-nvfp4",)
    nested = {"quantization_config": {"quant_method": "modelopt"} | HF_QUANT_CONFIG}
    assert declared_layouts(None, nested) == ("modelopt-nvfp4",)
    mixed = {
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"a": {"quant_algo": "NVFP4"}, "b": {"quant_algo": "FP8"}},
        }
    }
    assert declared_layouts(mixed, None) == ("modelopt-nvfp4", "modelopt:FP8")
    fp8 = {"quantization_config": {"quant_method": "fp8"}}
    assert declared_layouts(None, fp8) == ("fp8",)
    assert declared_layouts(None, {"model_type": "llama"}) == ()


def test_problems_give_exit_status_1(tmp_path, capsys):
    tensors = _modelopt_tensors(_quantized(3))
    name = "model.layers.0.mlp.down_proj.weight_scale"
    scales = tensors[name].copy()
    scales[0, 0] = np.nan
    tensors[name] = scales
    tensors["model.layers.0.mlp.up_proj.weight_scale_2"] = np.array(0.0, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert main(["inspect", str(tmp_path / "model.safetensors")]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: model.layers.0.mlp.down_proj: 1 NaN block scales" in out
    assert (
        "PROBLEM: model.layers.0.mlp.up_proj: model.layers.0.mlp.up_proj.weight_scale_2 = 0.0"
        in out
    )


def test_sharded_directory_merges_modules_split_across_shards(tmp_path, capsys):
    tensors = _modelopt_tensors(_quantized(4)) | _plain(5)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard_names in shards.items():
        save_file(
            {n: tensors[n] for n in shard_names}, str(tmp_path / file), metadata={"format": "pt"}
        )
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": {n: f for f, ns in shards.items() for n in ns},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    code, doc = _run_json(capsys, tmp_path)
    (ckpt,) = doc["checkpoints"]
    assert code == 0
    assert len(ckpt["files"]) == 2
    assert sorted(q["module"] for q in ckpt["quantized"]) == sorted(LINEARS)
    assert ckpt["warnings"] == []
    # a wrong total_size and a tensor the index misses are warnings
    index["metadata"]["total_size"] += 1
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    warnings = inspect_checkpoint(tmp_path).warnings
    assert any("total_size" in w for w in warnings)
    assert any("1 tensors missing from the index" in w for w in warnings)


def _bad_input(capsys, *args) -> str:
    assert main(["inspect", *map(str, args)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err


def test_bad_inputs_exit_2_with_one_line(modelopt_dir, tmp_path, capsys):
    directory, _, _ = modelopt_dir
    path = directory / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 10)
    assert "model.safetensors" in _bad_input(capsys, path)
    assert "truncated" in _bad_input(capsys, directory)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10" + b"\0" * 7 + b"not json at all!")
    assert "garbage.safetensors: header is not valid JSON" in _bad_input(capsys, garbage)
    assert "no such file or directory" in _bad_input(capsys, tmp_path / "missing.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no model.safetensors.index.json and no model*.safetensors" in _bad_input(capsys, empty)
    (empty / "model.safetensors.index.json").write_text('{"weight_map": {"a": "gone.safetensors"}}')
    assert "gone.safetensors" in _bad_input(capsys, empty)


def test_duplicate_tensor_across_shards_is_bad_input(tmp_path, capsys):
    save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "model-1.safetensors"))
    save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "model-2.safetensors"))
    assert "tensor 'x' is also in" in _bad_input(capsys, tmp_path)


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["inspect"])
    assert info.value.code == 2


def test_module_entry_point_in_a_subprocess(modelopt_dir):
    """One real process (importing the package can take seconds when JAX is installed)."""
    directory, _, _ = modelopt_dir
    command = [sys.executable, "-m", "nvfp4_format.cli", "inspect", str(directory), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert len(doc["checkpoints"][0]["quantized"]) == len(LINEARS)


def test_inspect_of_a_large_sparse_checkpoint_needs_little_memory(tmp_path):
    # 1.27 GiB of packed codes and scales (sparse on disk): the statistics read it in chunks
    import struct
    import subprocess
    import sys

    rows, k = 73728, 32768
    packed, scales = rows * k // 2, rows * k // 16
    name = "model.layers.0.mlp.down_proj"
    header = {
        f"{name}.weight": {"dtype": "U8", "shape": [rows, k // 2], "data_offsets": [0, packed]},
        f"{name}.weight_scale": {
            "dtype": "F8_E4M3", "shape": [rows, k // 16], "data_offsets": [packed, packed + scales],
        },
        f"{name}.weight_scale_2": {
            "dtype": "F32", "shape": [], "data_offsets": [packed + scales, packed + scales + 4],
        },
        "__metadata__": {"format": "pt"},
    }  # fmt: skip
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + packed + scales + 4)
    # The peak is VmHWM, this process's own high-water mark: ru_maxrss survives exec and so
    # reports the forking parent's size (a pytest-xdist worker with JAX loaded: ~650 MiB).
    probe = (
        "import re, sys; from nvfp4_format.cli import main; main(['inspect', sys.argv[1]]);"
        "print(re.search(r'VmHWM:\\s*(\\d+) kB', open('/proc/self/status').read())[1])"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    peak_kib = int(done.stdout.strip().splitlines()[-1])
    assert "100.0%" in done.stdout  # all codes (and scales) zero: it read every byte
    assert peak_kib < 300 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB for a 1.27 GiB file"
