"""`export_hf(layout="bf16")`: every tensor the master rounded to bfloat16 under the names the
FP4 layouts use, sealed and verified like them, loaded by plain transformers; FP4-only options
refused."""

from __future__ import annotations

import importlib.util
import json

import ml_dtypes
import numpy as np
import pytest
from conftest import MOE_CASES

from nvfp4_export import ExportError, export_hf, load_export, read_checkpoint, resolve_checkpoint
from nvfp4_export.cli import main
from nvfp4_export.forward import forward
from nvfp4_export.linears import hf_modules
from nvfp4_export.manifest import sealing_problems
from nvfp4_export.reload import weights_from_export
from nvfp4_export.verify import verify

CASES = ("dense", *sorted(MOE_CASES))
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
"""The ModelOpt tensors that only quantized linears have."""


@pytest.fixture(scope="module")
def runs(tiny_run, moe_runs):
    return {"dense": tiny_run, **moe_runs}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """(bf16 export, modelopt export) of every run."""
    out = tmp_path_factory.mktemp("bf16_exports")
    return {
        case: tuple(
            export_hf(run, out / f"{case}-{layout}", layout=layout).out_dir
            for layout in ("bf16", "modelopt")
        )
        for case, run in runs.items()
    }


def _master_bf16(kernel_IxO: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(kernel_IxO.T.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("case", CASES)
def test_names_are_the_modelopt_exports_with_every_linear_as_weight(exports, case):
    bf16, modelopt = (load_export(p) for p in exports[case])
    mo = modelopt.tensors
    linears = {
        f"{name}.weight"
        for source in bf16.spec.linear_paths()
        for name, _ in hf_modules(bf16.spec, source)
    }
    unquantized = {n for n, t in mo.items() if t.dtype == ml_dtypes.bfloat16}
    assert set(bf16.tensors) == unquantized | linears
    assert set(bf16.tensors) == {n for n in mo if not n.endswith(SCALE_SUFFIXES)}
    assert {t.dtype.name for t in bf16.tensors.values()} == {"bfloat16"}
    for name in unquantized:  # embeddings, norms, routers, lm_head, BF16-trained linears
        assert bf16.tensors[name].tobytes() == mo[name].tobytes(), name


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_is_the_master_rounded_to_bfloat16(exports, runs, case):
    loaded = load_export(exports[case][0])
    spec, params = loaded.spec, read_checkpoint(resolve_checkpoint(runs[case])).params
    for source in spec.linear_paths():
        kernel = params[f"{source}.kernel"]
        experts = range(spec.num_experts) if kernel.ndim == 3 else [None]
        for e in experts:
            w_OxI = _master_bf16(kernel if e is None else kernel[e])
            names = hf_modules(spec, source, e)
            starts = np.cumsum([0] + [rows for _, rows in names])
            for (name, _), lo, hi in zip(names, starts[:-1], starts[1:], strict=True):
                stored = loaded.tensors[f"{name}.weight"]
                assert stored.tobytes() == w_OxI[lo:hi].tobytes(), name
    embed = params["embed.embedding"].astype(ml_dtypes.bfloat16)
    assert loaded.tensors["model.embed_tokens.weight"].tobytes() == embed.tobytes()
    head = _master_bf16(params["lm_head.kernel"])
    assert loaded.tensors["lm_head.weight"].tobytes() == head.tobytes()
    norm = params["final_norm.scale"].astype(ml_dtypes.bfloat16)
    assert loaded.tensors["model.norm.weight"].tobytes() == norm.tobytes()


@pytest.mark.parametrize("case", ["dense", "qwen3_moe", "mixtral"])
def test_transformers_loads_it_and_computes_the_float_forward(exports, case):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = exports[case][0]
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert not (path / "hf_quant_config.json").exists() and (path / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    loaded = load_export(path)
    tokens = np.random.default_rng(1).integers(0, loaded.spec.vocab_size, size=(2, 12))
    with torch.no_grad():
        got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    want = forward(weights_from_export(loaded), tokens, activations="none", compute_dtype="float32")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()) + 1e-5)
    assert transformers.AutoTokenizer.from_pretrained(str(path)).eos_token_id == 256


@pytest.mark.parametrize("case", ["dense", "qwen2_moe"])
def test_verify_passes_and_catches_a_changed_weight(exports, runs, case, tmp_path):
    path = exports[case][0]
    manifest = load_export(path).provenance
    assert manifest["layout"] == manifest["format"] == "bf16" and not manifest["w4a4"]
    assert "nvfp4" in manifest["recipes"].values()  # the trained recipes, as found
    assert sealing_problems(path, manifest) == ([], [])
    report = verify(path, against=runs[case])
    assert report.ok and report.complete, report
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        assert any(c.name == "transformers (BF16)" and c.passed for c in report.comparisons)


def test_a_weight_off_by_one_bit_is_reported(runs, tmp_path):
    from safetensors.numpy import save_file

    from nvfp4_format.safetensors_file import load_safetensors

    out = export_hf(runs["dense"], tmp_path / "bf16", layout="bf16").out_dir
    tensors, _ = load_safetensors(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    bits = tensors[name].view(np.uint16).copy()
    bits[0, 0] ^= 1
    tensors[name] = bits.view(ml_dtypes.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    report = verify(out, against=runs["dense"])
    assert not report.ok
    assert any("model.safetensors is not the file" in p for p in report.problems)
    assert any(name.removesuffix(".weight") in p and "differs" in p for p in report.problems)


def test_sharded_like_the_other_layouts(runs, tmp_path):
    out = export_hf(runs["qwen3_moe"], tmp_path / "bf16", layout="bf16", max_shard_bytes=20_000)
    index = json.loads((out.out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert verify(out.out_dir, against=runs["qwen3_moe"]).ok


@pytest.mark.parametrize(
    "options, flag",
    [({"weight_only": True}, "--weight-only"), ({"calibrate_n": 4}, "--calibrate"),
     ({"calibration_text": "x.txt"}, "--calibration-text")],
)  # fmt: skip
def test_fp4_only_options_are_refused(runs, tmp_path, options, flag):
    with pytest.raises(ExportError, match=f"{flag} does not apply to --layout bf16"):
        export_hf(runs["dense"], tmp_path / "bf16", layout="bf16", **options)
    assert not (tmp_path / "bf16").exists()


def test_cli(runs, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert main(["hf", str(runs["dense"]), str(out), "--layout", "bf16", "--no-progress"]) == 0
    assert "(bf16, bf16, unquantized;" in capsys.readouterr().out
    assert main(["hf", str(runs["dense"]), str(out), "--layout", "bf16", "--weight-only"]) == 2
    assert "--weight-only does not apply to --layout bf16" in capsys.readouterr().err
    assert main(["verify", str(out), "--against", str(runs["dense"])]) == 0
