"""TransformerEngine's JAX grouped GEMM still takes no NVFP4 operands in the release under test,
which is why `nvfp4_ops.ragged_dot` refuses backend="te" (te_grouped.py reads the sources); the
day a release handles NVFP4 there, this fails and names where."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import te_grouped


def test_te_grouped_gemm_still_takes_no_nvfp4(te_root, te_version):
    signs = te_grouped.grouped_nvfp4_signs(te_root)
    assert signs == [], (
        f"TransformerEngine {te_version}'s JAX grouped GEMM may take NVFP4 now: {signs}. "
        "nvfp4_ops refuses backend='te' for ragged_dot (te_backend.TE_GROUPED_UNSUPPORTED): "
        "check TE's grouped_dense with NVFP4BlockScaling and lift or update the refusal"
    )


@pytest.mark.parametrize(
    "relative, old, new, sign",
    [
        (
            "transformer_engine/jax/cpp_extensions/quantization.py",
            "def grouped_quantize(",
            "def grouped_quantize_v2(",
            "grouped_quantize is gone",
        ),
        (
            "transformer_engine/jax/quantize/tensor.py",
            "has_rht_applied=False,",
            "has_rht_applied=rht,",
            "no longer passes has_rht_applied=False",
        ),
        (
            "transformer_engine/jax/cpp_extensions/quantization.py",
            "    if quantizer.scaling_mode == ScalingMode.DELAYED_TENSOR_SCALING:",
            "    if quantizer.scaling_mode.is_nvfp4_scaling:\n        pass\n"
            "    if quantizer.scaling_mode == ScalingMode.DELAYED_TENSOR_SCALING:",
            "grouped_quantize now names is_nvfp4_scaling",
        ),
    ],
)
def test_the_check_sees_a_release_that_changed(te_root, tmp_path, relative, old, new, sign):
    copy = tmp_path / "release"
    for path in te_grouped.GROUPED_DEFINITIONS:
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(te_root) / path, copy / path)
    source = (copy / relative).read_text()
    assert old in source
    (copy / relative).write_text(source.replace(old, new, 1))
    signs = te_grouped.grouped_nvfp4_signs(copy)
    assert any(sign in s for s in signs), signs
