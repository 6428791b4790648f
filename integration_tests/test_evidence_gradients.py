"""examples/evidence/gradient_quality.py on a tiny model: the report's structure and the properties
the recipe's parts must show on any operands (16x16 tiles give Fprop and Dgrad the same weight,
stochastic rounding of dy is unbiased, RNE rounding of dy is not, FP8 is more accurate than NVFP4)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples/evidence/gradient_quality.py"
RECIPES = ("nvfp4", "nvfp4-naive", "fp8")
LINEARS = ("layers.1.mlp.down",)
SR_RECIPES = ("nvfp4",)


def _load_script():
    spec = importlib.util.spec_from_file_location("gradient_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("evidence")
    script = _load_script()
    script.main([
        "--config", str(ROOT / "examples/configs/tiny.yaml"), "--draws", "4",
        "--out-dir", str(out), "--recipes", ",".join(RECIPES), "--linears", r"layers\.1\.mlp\.down",
        "--set", "train.batch_size=4",
    ])  # fmt: skip
    return json.loads((out / "gradients.json").read_text()), out


def _per_linear(report: dict, recipe: str) -> dict[str, dict]:
    return report["sources"]["init"]["recipes"][recipe]["per_linear"]


def test_outputs_and_structure(report):
    data, out = report
    assert (out / "gradients.png").stat().st_size > 1000
    text = (out / "gradients.md").read_text()
    assert all(f"| {name} |" in text for name in RECIPES)
    source = data["sources"]["init"]
    assert list(source["recipes"]) == list(RECIPES)
    assert sorted(source["shapes"]) == sorted(LINEARS)
    assert source["shapes"]["layers.1.mlp.down"] == {"M": 4 * 64, "K": 192, "N": 64}
    for name in RECIPES:
        res = source["recipes"][name]
        assert sorted(res["per_linear"]) == sorted(LINEARS)
        for key in ("wgrad_bias", "wgrad_noise_floor", "dgrad_cos", "fprop_rel_error"):
            stats = res["summary"][key]
            assert stats["mean"] <= stats["max"]
        row = res["per_linear"]["layers.1.mlp.down"]
        assert {"fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"} <= set(row["roles"])
        assert 0.9 < row["wgrad_cos"] <= 1.0 and 0.9 < row["dgrad_cos"] <= 1.0
        assert row["draws"] == (4 if name in SR_RECIPES else 1)


def test_2d_tiles_and_per_tensor_give_one_weight_1d_blocks_do_not(report):
    data, _ = report
    for name in ("nvfp4", "fp8"):
        assert all(r["weight_consistency"] == 0.0 for r in _per_linear(data, name).values())
        assert all("dgrad_w" not in r["roles"] for r in _per_linear(data, name).values())
    rows = _per_linear(data, "nvfp4-naive").values()
    assert all(r["weight_consistency"] > 0.01 for r in rows)
    assert all("dgrad_w" in r["roles"] for r in rows)  # 1D weights are re-quantized for Dgrad


def test_stochastic_rounding_of_dy_is_unbiased_and_rne_is_not(report):
    data, _ = report
    for name in SR_RECIPES:
        for row in _per_linear(data, name).values():
            for gemm in ("dgrad", "wgrad"):
                floor = row[f"{gemm}_noise_floor"]
                assert floor > 0
                assert row[f"{gemm}_dy_rounding_bias"] < 2.0 * floor, (name, gemm, row)
    for row in _per_linear(data, "nvfp4-naive").values():
        assert row["wgrad_noise_floor"] == 0.0 and row["wgrad_dy_rounding_bias"] > 0.005
        assert row["wgrad_bias"] == pytest.approx(row["wgrad_rel_error"], rel=1e-4)


def test_fp8_is_more_accurate_than_nvfp4(report):
    data, _ = report
    fp8, nv = _per_linear(data, "fp8"), _per_linear(data, "nvfp4")
    for path in LINEARS:
        for key in ("fprop_rel_error", "dgrad_rel_error", "wgrad_rel_error"):
            assert fp8[path][key] < nv[path][key], (path, key)
        assert (
            fp8[path]["roles"]["wgrad_dy"]["rel_error"] < nv[path]["roles"]["wgrad_dy"]["rel_error"]
        )
