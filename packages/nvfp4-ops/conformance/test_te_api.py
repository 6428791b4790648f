"""Every TransformerEngine name, keyword, field and enum member te_backend uses exists in the
release under test (parsed from its sources; see te_api.py), and the check catches a wrong one."""

from __future__ import annotations

from pathlib import Path

import pytest
import te_api

import nvfp4_ops.te_backend as te_backend

SOURCE = Path(te_backend.__file__).read_text()


def test_the_extraction_sees_what_te_backend_calls():
    found = {str(u) for u in te_api.uses(SOURCE)}
    for expected in (
        "transformer_engine.jax.quantize.QuantizerFactory.create_set(fp8_recipe, quantize_meta_set)",
        "transformer_engine.jax.quantize.QuantizeMeta(stochastic_rounding_rng_state, use_rht)",
        "transformer_engine.jax.quantize.QuantizeMetaSet(grad, kernel, x)",
        "transformer_engine.jax.quantize.TensorUsage.LHS_TRANS",
        "transformer_engine.jax.cpp_extensions.quantize(amax_scope, flatten_axis, quantizer)",
        "transformer_engine.jax.cpp_extensions.amax.AmaxScope.FSDP",
        "transformer_engine.jax.cpp_extensions.amax.AmaxScope.TPSP",
        "transformer_engine.jax.sharding.MeshResource(dp_resource, fsdp_resource)",
        "transformer_engine.jax.sharding.global_shard_guard",
        "transformer_engine.jax.cpp_extensions.gemm(contracting_dims)",
        "transformer_engine.jax.sharding.get_num_devices_in_mesh",
        "transformer_engine.common.recipe.NVFP4BlockScaling(disable_2d_quantization, disable_rht,"
        " disable_stochastic_rounding)",
    ):
        assert expected in found, sorted(found)


def test_every_use_exists_in_the_release(te_root):
    needed = te_api.uses(SOURCE) + list(te_api.RESULT_USES)
    assert te_api.missing(te_root, needed) == []


def test_neutral_recipe_fields_are_fields_of_the_newest_release(te_root, te_version):
    if te_version != te_backend.TE_TESTED_VERSIONS[-1]:
        pytest.skip("fields are added over releases; the newest must have every one we pin")
    recipe = te_api.resolve(te_api.Release(te_root), "transformer_engine.common.recipe",
                            ("NVFP4BlockScaling",))  # fmt: skip
    fields = te_api.Release(te_root).fields(recipe)
    assert set(te_backend.NEUTRAL_RECIPE_FIELDS) <= fields


@pytest.mark.parametrize(
    "old, new, problem",
    [
        (
            "quantize_meta_set=metas",
            "quantize_metas=metas",
            "does not take the keyword 'quantize_metas'",
        ),
        ("disable_rht=", "disable_hadamard=", "does not take the keyword 'disable_hadamard'"),
        ("usage=usage.LHS)", "usage=usage.LHS_ROWWISE)", "TensorUsage.LHS_ROWWISE does not exist"),
        ("QuantizeMeta(use_rht=rht)", "QuantizeMeta(use_hadamard=rht)", "'use_hadamard'"),
        ("tex.gemm(", "tex.scaled_gemm(", "cpp_extensions.scaled_gemm does not exist"),
        ('"transformer_engine.jax.sharding"', '"transformer_engine.jax.shard"', "shard.get_num"),
        ('amax_scope=_amax_scope("x")', 'scope=_amax_scope("x")', "take the keyword 'scope'"),
    ],
)
def test_a_wrong_name_or_keyword_fails_the_check(te_root, old, new, problem):
    assert old in SOURCE
    broken = SOURCE.replace(old, new, 1)
    problems = te_api.missing(te_root, te_api.uses(broken))
    assert any(problem in p for p in problems), problems
