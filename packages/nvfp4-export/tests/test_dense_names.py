"""The dense-tensor table: HF names, BF16 tensors, reload and the param tree all read it alike."""

import ml_dtypes
import numpy as np
import pytest

from nvfp4_export.dense_names import LAYER_TENSORS
from nvfp4_export.hf_files import dense_tensors, hf_dense_names
from nvfp4_export.model_spec import LlamaSpec, dense_entries
from nvfp4_export.reload import _from_hf, dense_layer_names

FLAGS = ("qkv_bias", "o_bias", "qk_norm", "tie_embeddings")


def _spec(num_layers: int = 2, **flags) -> LlamaSpec:
    return LlamaSpec(
        vocab_size=40, d_model=32, num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=16,
        mlp_dim=48, **flags,
    )  # fmt: skip


def _params(spec: LlamaSpec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in spec.expected_params().items()
    }


def _bf16_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def test_all_flags_on_names_every_tensor_in_the_historical_order():
    spec = _spec(**dict.fromkeys(FLAGS, True), num_layers=1)
    layer = "model.layers.0."
    assert hf_dense_names(spec) == [
        "model.embed_tokens.weight", "model.norm.weight",
        layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight",
        layer + "self_attn.q_proj.bias", layer + "self_attn.k_proj.bias",
        layer + "self_attn.v_proj.bias", layer + "self_attn.o_proj.bias",
        layer + "self_attn.q_norm.weight", layer + "self_attn.k_norm.weight",
    ]  # fmt: skip
    assert list(dense_tensors(spec, _params(spec))) == [
        "model.embed_tokens.weight",
        *hf_dense_names(spec)[2:],
        "model.norm.weight",
    ]
    assert dense_layer_names(spec) == [t.key for t in LAYER_TENSORS]


def test_all_flags_off_keeps_norms_and_an_untied_lm_head():
    spec = _spec()
    assert hf_dense_names(spec)[:3] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert len(hf_dense_names(spec)) == 3 + 2 * spec.num_layers
    assert dense_layer_names(spec) == ["attn_norm", "mlp_norm"]


@pytest.mark.parametrize("on", [False, True])
@pytest.mark.parametrize("flag", FLAGS)
def test_written_names_are_the_listed_names(flag, on):
    flags = {f: (f == flag) == on for f in FLAGS}
    spec = _spec(**flags)
    written = dense_tensors(spec, _params(spec))
    assert sorted(written) == sorted(hf_dense_names(spec))
    assert len(set(hf_dense_names(spec))) == len(hf_dense_names(spec))


@pytest.mark.parametrize("on", [False, True])
def test_table_params_are_the_dense_part_of_the_param_tree(on):
    spec = _spec(**dict.fromkeys(FLAGS, on))
    dense = {t.param for t in dense_entries(spec)}
    kernels = {p for p in spec.expected_params() if p.endswith(".kernel") and "lm_head" not in p}
    assert dense | kernels == set(spec.expected_params())
    assert not dense & kernels


def test_split_biases_and_transposed_lm_head_read_back_as_forward_weights_hold_them():
    spec = _spec(qkv_bias=True, o_bias=True, qk_norm=True)
    params = _params(spec, seed=1)
    written = dense_tensors(spec, params)
    q, k, v = spec.qkv_split
    bias = params["layers.1.attn.qkv.bias"]
    assert written["model.layers.1.self_attn.k_proj.bias"].shape == (k,)
    np.testing.assert_array_equal(
        written["model.layers.1.self_attn.v_proj.bias"].astype(np.float32),
        _bf16_f32(bias[q + k : q + k + v]),
    )
    assert written["lm_head.weight"].shape == (spec.vocab_size, spec.d_model)
    for t in dense_entries(spec):
        got = _from_hf(spec, t, lambda name: written[name].astype(np.float32))
        want = params[t.param].T if t.transposed else params[t.param]
        np.testing.assert_array_equal(got, _bf16_f32(want), err_msg=t.key)
