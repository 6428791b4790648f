"""Export re-quantizes exactly as training's forward did, then splits fused outputs."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import nvfp4_format
from nvfp4_export import ExportError, LlamaSpec, export_linear
from nvfp4_export.linears import dequantize_linear, master_bf16_linear

SPEC = LlamaSpec(vocab_size=32, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, mlp_dim=96)  # fmt: skip


def _kernel(shape, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(shape).astype(np.float32) * 0.05
    k[3, 5] = 0.7  # one outlier sets the fused group's amax (inside q's rows)
    return k


def test_fused_qkv_is_one_2d_quantization_split_by_rows():
    kernel = _kernel((64, 128))
    mods = export_linear(SPEC, "layers.0.attn.qkv", kernel, "nvfp4", None)
    assert [m.name.rsplit(".", 1)[1] for m in mods] == ["q_proj", "k_proj", "v_proj"]
    w_t = kernel.astype(ml_dtypes.bfloat16).astype(np.float32).T  # the compute-dtype weight
    q = nvfp4_format.quantize(w_t, (16, 16))
    np.testing.assert_array_equal(np.concatenate([m.packed for m in mods]), q.packed)
    scales = np.concatenate([m.scales for m in mods]).view(np.uint8)
    np.testing.assert_array_equal(scales, q.block_scales.view(np.uint8))
    assert {float(m.global_decode_scale) for m in mods} == {float(q.global_scale)}
    # 16x16 tiles: every 16 rows share their block scales
    tiles = scales.reshape(-1, 16, scales.shape[1])
    assert (tiles == tiles[:, :1, :]).all()
    # the dequantized export equals the model's dequantized weight
    deq = np.concatenate([dequantize_linear(m) for m in mods])
    np.testing.assert_array_equal(deq, nvfp4_format.dequantize(q))


def test_gate_up_split_and_1d_recipe_and_the_bf16_cast_matters():
    kernel = _kernel((64, 192), seed=1)
    mods = export_linear(SPEC, "layers.1.mlp.gate_up", kernel, "nvfp4-no-2d", None)
    assert [m.shape for m in mods] == [(96, 64), (96, 64)]
    w_t = kernel.astype(ml_dtypes.bfloat16).astype(np.float32).T
    q = nvfp4_format.quantize(w_t, (1, 16))
    np.testing.assert_array_equal(np.concatenate([m.packed for m in mods]), q.packed)
    q32 = nvfp4_format.quantize(np.ascontiguousarray(kernel.T), (1, 16))
    assert not np.array_equal(q32.packed, q.packed), "quantizing FP32 masters gives other codes"


def test_mxfp4_and_bf16_recipes():
    kernel = _kernel((96, 64), seed=2)
    (mx,) = export_linear(SPEC, "layers.0.mlp.down", kernel, "mxfp4", 1.5)
    w_t = kernel.astype(ml_dtypes.bfloat16).astype(np.float32).T
    ref = nvfp4_format.quantize_mxfp4(w_t, "ocp")
    np.testing.assert_array_equal(mx.packed, ref.packed)
    np.testing.assert_array_equal(mx.scales, ref.scales)
    assert mx.scales.shape == (64, 3) and mx.input_amax == 1.5
    (bf,) = export_linear(SPEC, "layers.0.mlp.down", kernel, "bf16", None)
    assert bf.weight.dtype == ml_dtypes.bfloat16 and bf.weight.shape == (64, 96)


def test_unsupported_recipes_are_refused():
    with pytest.raises(ExportError, match="fp8"):
        export_linear(SPEC, "layers.0.attn.o", _kernel((64, 64)), "fp8", None)
    with pytest.raises(ExportError, match="unknown recipe 'int4'"):
        export_linear(SPEC, "layers.0.attn.o", _kernel((64, 64)), "int4", None)


def test_the_bf16_layout_rounds_the_master_once_whatever_the_compute_dtype():
    """1 + 2^-8 + 2^-11 rounds to 1 + 2^-7 in bfloat16, but to 1 + 2^-8 in float16 and then to 1
    (a tie, to even): the bf16 layout holds the master rounded once, not the float16 weight."""
    kernel = _kernel((96, 64))  # mlp.down: [in = mlp_dim, out = d_model]
    kernel[0, 0] = np.float32(1 + 2**-8 + 2**-11)
    spec = dataclasses.replace(SPEC, dtype="float16")
    (master,) = master_bf16_linear(spec, "layers.0.mlp.down", kernel)
    assert (
        master.weight.tobytes()
        == np.ascontiguousarray(kernel.T.astype(ml_dtypes.bfloat16)).tobytes()
    )
    assert master.weight[0, 0] == 1 + 2**-7
    (as_trained,) = export_linear(spec, "layers.0.mlp.down", kernel, "bf16", None)
    assert as_trained.weight[0, 0] == 1
