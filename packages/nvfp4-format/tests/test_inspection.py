"""Layout detection and per-tensor statistics on files written by `safetensors`."""

import functools

import ml_dtypes
import numpy as np
import pytest
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file

import nvfp4_format as nf
from nvfp4_format.block_statistics import block_scale_statistics, code_statistics
from nvfp4_format.inspection import (
    LAYOUT_CT_MXFP4,
    LAYOUT_CT_NVFP4,
    LAYOUT_MODELOPT_NVFP4,
    inspect_module,
)
from nvfp4_format.layout_detection import detect_quantized_modules
from nvfp4_format.safetensors_file import read_tensor
from nvfp4_format.safetensors_header import TensorInfo, read_safetensors_header

OUT, IN = 24, 64


def _codes(packed: np.ndarray) -> np.ndarray:
    """Independent unpacking: even index in the low nibble."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _weight(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    w[0, :16] = 0.0  # one all-zero block: zero block scale, zero codes
    w[1, 16:32] *= 1e-3
    return w


def _modelopt(m: str, q: nf.NVFP4Array) -> dict[str, np.ndarray]:
    return {
        f"{m}.weight": np.asarray(q.packed),
        f"{m}.weight_scale": np.asarray(q.block_scales),
        f"{m}.weight_scale_2": np.asarray(q.global_scale, np.float32),
        f"{m}.input_scale": np.array(0.25, np.float32),
    }


def _compressed(m: str, q: nf.NVFP4Array) -> dict[str, np.ndarray]:
    return {
        f"{m}.weight_packed": np.asarray(q.packed),
        f"{m}.weight_scale": np.asarray(q.block_scales),
        f"{m}.weight_global_scale": (1 / np.asarray(q.global_scale, np.float32)).reshape(1),
        f"{m}.input_global_scale": np.array([8.0], np.float32),
    }


def _inspect(tmp_path, tensors: dict[str, np.ndarray]):
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    header = read_safetensors_header(path)
    read = functools.partial(read_tensor, header)
    modules = detect_quantized_modules(header.tensors)
    return modules, [inspect_module(q, header.tensors, read) for q in modules]


@pytest.mark.parametrize("layout", [LAYOUT_MODELOPT_NVFP4, LAYOUT_CT_NVFP4])
def test_nvfp4_statistics_match_independent_counts(tmp_path, layout):
    q = nf.quantize(_weight(0))
    build = _modelopt if layout == LAYOUT_MODELOPT_NVFP4 else _compressed
    tensors = build("model.layers.0.mlp.down_proj", q)
    tensors["model.norm.weight"] = np.ones(IN, ml_dtypes.bfloat16)
    modules, (report,) = _inspect(tmp_path, tensors)

    assert [m.module for m in modules] == ["model.layers.0.mlp.down_proj"]
    assert report.layout == layout
    assert report.shape == (OUT, IN)
    assert report.problems == ()
    codes = _codes(q.packed)
    np.testing.assert_array_equal(codes, nf.unpack_fp4(q.packed))
    assert report.codes.count == OUT * IN
    assert report.codes.zero_fraction == np.isin(codes, (0, 8)).mean()
    assert report.codes.saturated_fraction == np.isin(codes, (7, 15)).mean()
    assert report.codes.histogram == tuple(np.bincount(codes.ravel(), minlength=16))
    assert report.codes.zero_fraction >= 16 / (OUT * IN)  # the all-zero block
    assert report.codes.saturated_fraction > 0  # every block's amax maps onto +-6

    scales = np.asarray(q.block_scales).astype(np.float32)
    assert report.block_scales.count == OUT * IN // 16
    assert report.block_scales.max == scales.max() == 448.0
    assert report.block_scales.min_nonzero == scales[scales > 0].min()
    assert report.block_scales.zero_fraction == (scales == 0).mean() > 0
    assert report.global_decode_scale == pytest.approx(float(q.global_scale), rel=1e-6)
    expected_input = 0.25 if layout == LAYOUT_MODELOPT_NVFP4 else 1 / 8.0
    assert report.input_decode_scale == expected_input
    weight_bytes = OUT * IN // 2 + OUT * IN // 16 + 4
    assert report.weight_bytes == weight_bytes
    assert report.storage_bytes == weight_bytes + 4
    assert report.bits_per_element == 8 * weight_bytes / (OUT * IN)
    assert report.bf16_bytes == 2 * OUT * IN


def test_mxfp4_compressed_tensors(tmp_path):
    mx = nf.quantize_mxfp4(_weight(1))
    m = "model.layers.1.mlp.up_proj"
    tensors = {f"{m}.weight_packed": np.asarray(mx.packed), f"{m}.weight_scale": mx.scales}
    _, (report,) = _inspect(tmp_path, tensors)
    assert report.layout == LAYOUT_CT_MXFP4
    assert report.problems == ()
    assert report.global_decode_scale is None
    exponents = np.asarray(mx.scales).astype(np.float64)
    assert report.block_scales.max == 2.0 ** (exponents.max() - 127)
    assert report.block_scales.min_nonzero == 2.0 ** (exponents.min() - 127)
    assert report.block_scales.zero_fraction == 0.0
    codes = _codes(mx.packed)
    assert report.codes.saturated_fraction == np.isin(codes, (7, 15)).mean()
    assert report.bits_per_element == 8 * (OUT * IN // 2 + OUT * IN // 32) / (OUT * IN)


def _info(dtype: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo("", dtype, shape, 0, 0)


def test_detection_from_names_dtypes_and_shapes():
    tensors = {
        "a.weight": _info("U8", (8, 16)),
        "a.weight_scale": _info("F8_E4M3", (8, 2)),
        "a.weight_scale_2": _info("F32", ()),
        "b.weight_packed": _info("U8", (8, 16)),
        "b.weight_scale": _info("F8_E4M3", (8, 2)),
        "b.weight_global_scale": _info("F32", (1,)),
        "c.weight_packed": _info("U8", (8, 16)),
        "c.weight_scale": _info("U8", (8, 1)),
        "d.weight": _info("F4", (8, 32)),
        "d.weight_scale": _info("F8_E4M3", (8, 2)),
        # not FP4: compressed-tensors INT4 (I32 packed), ModelOpt FP8, plain BF16, lone U8
        "e.weight_packed": _info("I32", (8, 4)),
        "e.weight_scale": _info("BF16", (8, 1)),
        "f.weight": _info("F8_E4M3", (8, 32)),
        "f.weight_scale": _info("F32", ()),
        "g.weight": _info("BF16", (8, 32)),
        "h.weight": _info("U8", (8, 32)),
    }
    found = {m.module: m for m in detect_quantized_modules(tensors)}
    assert sorted(found) == ["a", "b", "c", "d"]
    assert found["a"].layout == LAYOUT_MODELOPT_NVFP4
    assert found["a"].tensor_names == ("a.weight", "a.weight_scale", "a.weight_scale_2")
    assert found["b"].layout == LAYOUT_CT_NVFP4
    assert found["b"].global_scale == "b.weight_global_scale"
    assert found["c"].layout == LAYOUT_CT_MXFP4
    assert found["d"].layout == LAYOUT_MODELOPT_NVFP4 and found["d"].global_scale is None


def test_code_statistics_on_every_byte_value():
    stats = code_statistics(np.arange(256, dtype=np.uint8).reshape(16, 16))
    assert stats.count == 512
    assert stats.histogram == (32,) * 16
    assert stats.zero_fraction == stats.saturated_fraction == 4 / 32


def test_code_statistics_hand_counted():
    packed = np.array([[0x70, 0xF7], [0x08, 0x21]], np.uint8)  # codes 0,7 | 7,15 | 8,0 | 1,2
    stats = code_statistics(packed)
    assert stats.zero_fraction == 3 / 8
    assert stats.saturated_fraction == 3 / 8
    with pytest.raises(TypeError, match="uint8"):
        code_statistics(packed.astype(np.int32))


def test_block_scale_statistics_e4m3_and_e8m0():
    e4m3 = np.array([0.0, 0.5, 448.0, np.nan, 2.0**-9, -1.0], ml_dtypes.float8_e4m3fn)
    stats = block_scale_statistics(e4m3)
    assert (stats.count, stats.nan_count, stats.negative_count) == (6, 1, 1)
    assert stats.min_nonzero == 2.0**-9
    assert stats.max == 448.0
    assert stats.zero_fraction == 1 / 6
    e8m0 = np.array([127, 120, 130, 255], np.uint8)
    stats = block_scale_statistics(e8m0, e8m0=True)
    assert (stats.min_nonzero, stats.max, stats.nan_count) == (2.0**-7, 8.0, 1)
    same = block_scale_statistics(e8m0.view(ml_dtypes.float8_e8m0fnu), e8m0=True)
    assert same == stats


def _broken(tmp_path, **changes):
    q = nf.quantize(_weight(2))
    tensors = _modelopt("lin", q) | {k: v for k, v in changes.items() if v is not None}
    for k in [k for k, v in changes.items() if v is None]:
        del tensors[k]
    _, (report,) = _inspect(tmp_path, {k.replace("__", "."): v for k, v in tensors.items()})
    return report


def test_problem_scale_shape_mismatch(tmp_path):
    wrong = np.ones((OUT, IN // 8), ml_dtypes.float8_e4m3fn)
    report = _broken(tmp_path, **{"lin.weight_scale": wrong})
    assert any("shape [24, 8], expected [24, 4] (in/16)" in p for p in report.problems)


def test_problem_in_not_multiple_of_16(tmp_path):
    q = nf.quantize(_weight(2))
    tensors = _modelopt("lin", q)
    tensors["lin.weight"] = np.asarray(q.packed)[:, :28]  # in = 56
    _, (report,) = _inspect(tmp_path, tensors)
    assert report.shape == (OUT, 56)
    assert any("in=56 is not a multiple of the block size 16" in p for p in report.problems)


def test_problem_scale_dtype(tmp_path):
    q = nf.quantize(_weight(2))
    as_f16 = np.asarray(q.block_scales).astype(np.float16)
    report = _broken(tmp_path, **{"lin.weight_scale": as_f16})
    assert any("dtype F16, expected F8_E4M3" in p for p in report.problems)
    assert report.block_scales.max == 448.0  # still measured


def test_problem_nan_scales(tmp_path):
    scales = np.asarray(nf.quantize(_weight(2)).block_scales).copy()
    scales[3, 1] = np.nan
    scales[5, 0] = np.nan
    report = _broken(tmp_path, **{"lin.weight_scale": scales})
    assert "2 NaN block scales in lin.weight_scale" in report.problems


@pytest.mark.parametrize("value", [0.0, -1e-3, np.inf])
def test_problem_global_scale_not_positive(tmp_path, value):
    report = _broken(tmp_path, **{"lin.weight_scale_2": np.array(value, np.float32)})
    assert report.global_decode_scale is None
    assert any(
        "lin.weight_scale_2 = " in p and "not a positive finite" in p for p in report.problems
    )


def test_problem_compressed_tensors_global_scale(tmp_path):
    q = nf.quantize(_weight(3))
    tensors = _compressed("lin", q)
    tensors["lin.weight_global_scale"] = np.array([-5.0], np.float32)
    _, (report,) = _inspect(tmp_path, tensors)
    assert report.problems == ("lin.weight_global_scale = -5.0 is not a positive finite scale",)
    del tensors["lin.weight_global_scale"]
    _, (report,) = _inspect(tmp_path, tensors)
    assert report.layout == LAYOUT_CT_NVFP4  # E4M3 scales: NVFP4 missing its global scale
    assert "missing global scale (lin.weight_global_scale)" in report.problems


def test_problem_missing_and_misshapen_global_scale(tmp_path):
    report = _broken(tmp_path, **{"lin.weight_scale_2": None})
    assert "missing global scale (lin.weight_scale_2)" in report.problems
    report = _broken(tmp_path, **{"lin.weight_scale_2": np.ones(3, np.float64)})
    assert "lin.weight_scale_2 has dtype F64, expected F32" in report.problems
    assert "lin.weight_scale_2 has shape [3], expected one element" in report.problems


def test_code_statistics_across_many_chunks():
    packed = np.random.default_rng(7).integers(0, 256, size=(3, 100_003), dtype=np.uint8)
    stats = code_statistics(packed)
    codes = _codes(packed)
    assert stats.histogram == tuple(np.bincount(codes.ravel(), minlength=16))
    assert stats.saturated_fraction == np.isin(codes, (7, 15)).mean()


def test_packed_weight_tagged_f4(tmp_path):
    """safetensors writes torch's float4_e2m1fn_x2 as dtype F4 with the logical shape."""
    q = nf.quantize(_weight(4))
    arrays = {
        "lin.weight": ("float4_e2m1fn_x2", np.ascontiguousarray(q.packed)),
        "lin.weight_scale": ("float8_e4m3fn", np.ascontiguousarray(q.block_scales)),
        "lin.weight_scale_2": ("float32", np.asarray(q.global_scale, np.float32)),
    }
    specs = {
        n: TensorSpec(dtype=d, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
        for n, (d, a) in arrays.items()
    }
    path = str(tmp_path / "f4.safetensors")
    serialize_file(specs, path, {"format": "pt"})
    header = read_safetensors_header(path)
    assert header.tensors["lin.weight"].dtype == "F4"
    assert header.tensors["lin.weight"].shape == (OUT, IN)
    (module,) = detect_quantized_modules(header.tensors)
    report = inspect_module(module, header.tensors, functools.partial(read_tensor, header))
    assert report.layout == LAYOUT_MODELOPT_NVFP4
    assert report.shape == (OUT, IN)
    assert report.problems == ()
    assert report.codes.histogram == tuple(np.bincount(_codes(q.packed).ravel(), minlength=16))
