"""The format table (`formats.FORMATS`), the layout vocabulary it takes from nvfp4_format, and the
reload's use of nvfp4_format's layout detection."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from nvfp4_export import ExportError, load_export
from nvfp4_export.eight_bit_formats import LAYOUT_CT_MXFP8, LAYOUT_MODELOPT_FP8
from nvfp4_export.formats import BF16, FORMAT_OF_LAYOUT, FORMATS, LAYOUTS, layout_names
from nvfp4_export.forward import ForwardLinear
from nvfp4_export.policy import RECIPE_WEIGHT_FORMATS
from nvfp4_export.reload import (
    bf16_dense,
    bf16_weights,
    linear_from_tensors,
    weights_from_export,
)
from nvfp4_format.inspection import LAYOUT_CT_MXFP4, LAYOUT_CT_NVFP4, LAYOUT_MODELOPT_NVFP4
from nvfp4_format.layout_names import LAYOUT_NAMES, WEIGHT_GLOBAL_SCALE

M = "model.layers.1.self_attn.q_proj"


def test_every_recipe_weight_format_is_in_the_table():
    for recipe, wf in RECIPE_WEIGHT_FORMATS.items():
        assert wf.fmt == BF16 or wf.fmt in FORMATS, recipe


def test_the_table_covers_every_layout_nvfp4_format_detects():
    # nvfp4_format detects the FP4 layouts; the 8-bit ones are export's (eight_bit_formats)
    assert set(FORMAT_OF_LAYOUT) == set(LAYOUT_NAMES) | {LAYOUT_CT_MXFP8, LAYOUT_MODELOPT_FP8}
    assert FORMAT_OF_LAYOUT[LAYOUT_MODELOPT_NVFP4] == FORMAT_OF_LAYOUT[LAYOUT_CT_NVFP4] == "nvfp4"
    assert FORMAT_OF_LAYOUT[LAYOUT_CT_MXFP4] == "mxfp4"
    for f in FORMATS.values():
        assert set(f.layouts) <= set(LAYOUTS), f.name
        assert f.global_scale == all(n.global_scale is not None for n in f.layouts.values())
        assert f.scale_values().shape == (256,)


def test_a_format_outside_its_layouts_is_an_export_error():
    with pytest.raises(ExportError, match="'mxfp4' is written in the layouts"):
        layout_names("mxfp4", "modelopt")


@pytest.fixture(scope="module")
def ct_export(tiny_run, tmp_path_factory):
    from nvfp4_export import export_hf

    out = tmp_path_factory.mktemp("formats") / "ct"
    return load_export(export_hf(tiny_run, out, layout="compressed-tensors").out_dir)


def test_reload_finds_modules_by_nvfp4_format_detection(ct_export):
    q = ct_export.quantized_modules[M]
    assert q.layout == LAYOUT_CT_NVFP4
    m = linear_from_tensors(ct_export, M, "layers.1.attn.qkv")
    assert m.fmt == "nvfp4" and m.global_encode_scale == ct_export.tensors[q.global_scale][0]
    bf16 = linear_from_tensors(ct_export, "model.layers.0.self_attn.q_proj", "layers.0.attn.qkv")
    assert bf16.fmt == BF16 and bf16.weight.dtype == ml_dtypes.bfloat16


def test_reload_names_a_missing_global_scale(ct_export):
    tensors = dict(ct_export.tensors)
    del tensors[f"{M}.{WEIGHT_GLOBAL_SCALE}"]
    broken = dataclasses.replace(ct_export, tensors=tensors)
    with pytest.raises(ExportError, match=f"lacks '{M}.{WEIGHT_GLOBAL_SCALE}'"):
        linear_from_tensors(broken, M, "layers.1.attn.qkv")


def _is_bf16(a: np.ndarray) -> bool:
    return np.array_equal(a, a.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_dense_and_bf16_weights_round_what_their_names_say(ct_export):
    w = weights_from_export(ct_export)
    noisy = dataclasses.replace(
        w,
        final_norm=w.final_norm + np.float32(1e-4),
        layers=tuple(
            {
                k: (
                    dataclasses.replace(v, w_OxI=v.w_OxI * np.float32(1.0001))
                    if isinstance(v, ForwardLinear)
                    else v + np.float32(1e-4)
                )
                for k, v in layer.items()
            }
            for layer in w.layers
        ),
    )
    dense, linears = bf16_dense(noisy), bf16_weights(noisy)
    assert _is_bf16(dense.final_norm) and _is_bf16(dense.layers[1]["attn_norm"])
    assert dense.layers[1]["qkv"] is noisy.layers[1]["qkv"]  # linears untouched
    assert _is_bf16(linears.layers[1]["qkv"].w_OxI)
    assert linears.layers[1]["attn_norm"] is noisy.layers[1]["attn_norm"]  # dense untouched
