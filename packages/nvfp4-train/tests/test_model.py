"""The Llama model: shapes, dtypes, causality, RoPE convention, GQA, config validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.attention import naive_attention
from nvfp4_train.model.blocks.rope import apply_rope, rope_cos_sin
from nvfp4_train.model.config import ModelConfig, linear_paths
from nvfp4_train.model.decoder import Llama


def tiny(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
        max_seq_len=32, scan_layers=False,  # these tests index blocks; test_scan.py scans
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def build(cfg: ModelConfig, recipe: str = "bf16", seed: int = 0) -> Llama:
    recipes = dict.fromkeys(linear_paths(cfg), nvfp4_ops.get_recipe(recipe))
    return Llama(cfg, recipes, rngs=nnx.Rngs(seed))


def run(model: Llama, inputs_BxL, key=None):
    """The model's forward pass, jitted (eager op-by-op dispatch is far slower on CPU)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda p, x, k: nnx.merge(graphdef, p)(x, key=k))(state, inputs_BxL, key)


def tokens(shape, seed=0, vocab=256):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def test_forward_shapes_and_dtypes():
    cfg = tiny()
    model = build(cfg)
    logits = run(model, tokens((3, 16)))
    assert logits.shape == (3, 16, 256)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    params = nnx.to_pure_dict(nnx.state(model))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    layer = params["layers"]["1"]
    assert layer["attn"]["qkv"]["kernel"].shape == (64, (4 + 2 * 2) * 16)
    assert layer["attn"]["o"]["kernel"].shape == (64, 64)
    assert layer["mlp"]["gate_up"]["kernel"].shape == (64, 256)
    assert layer["mlp"]["down"]["kernel"].shape == (128, 64)
    assert params["lm_head"]["kernel"].shape == (64, 256)
    assert params["embed"]["embedding"].shape == (256, 64)


def test_linear_output_is_compute_dtype():
    model = build(tiny(dtype="bfloat16"))
    out = model.layers["0"].mlp.gate_up(jnp.ones((2, 64), jnp.float32))
    assert out.dtype == jnp.bfloat16
    model32 = build(tiny(dtype="float32"))
    assert model32.layers["0"].mlp.gate_up(jnp.ones((2, 64))).dtype == jnp.float32


def test_tied_embeddings_have_no_head_and_use_embedding():
    cfg = tiny(tie_embeddings=True, dtype="float32")
    model = build(cfg)
    params = nnx.to_pure_dict(nnx.state(model))
    assert "lm_head" not in params
    x = tokens((1, 8))
    hidden = model.final_norm(
        model.layers["1"](model.layers["0"](model.embed(x), (None,) * 4), (None,) * 4)
    )
    expected = hidden @ params["embed"]["embedding"].T
    np.testing.assert_allclose(run(model, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_masking(dtype):
    model = build(tiny(dtype=dtype))
    x = tokens((2, 16))
    changed = x.at[:, 9].set((x[:, 9] + 1) % 256)
    a, b = run(model, x), run(model, changed)
    np.testing.assert_array_equal(a[:, :9], b[:, :9])
    assert float(jnp.max(jnp.abs(a[:, 9:] - b[:, 9:]))) > 0


def rope_reference(x_LxD: np.ndarray, theta: float) -> np.ndarray:
    """Rotates each pair (x[i], x[i + D/2]) by angle p * theta**(-2i/D), in float64."""
    length, dim = x_LxD.shape
    half = dim // 2
    out = np.empty_like(x_LxD, dtype=np.float64)
    for p in range(length):
        for i in range(half):
            angle = p * theta ** (-2.0 * i / dim)
            c, s = np.cos(angle), np.sin(angle)
            a, b = x_LxD[p, i], x_LxD[p, i + half]
            out[p, i] = a * c - b * s
            out[p, i + half] = b * c + a * s
    return out


def test_rope_matches_rotate_half_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 12, 3, 16)).astype(np.float32)
    cos, sin = rope_cos_sin(jnp.arange(12), 16, 500.0)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    for h in range(3):
        np.testing.assert_allclose(got[0, :, h], rope_reference(x[0, :, h], 500.0), atol=1e-5)


def attention_reference(q, k, v):
    """Plain multi-head causal attention in float64; q, k, v [B, L, H, D]."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    scores = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhls,bshd->blhd", probs, v)


def test_gqa_attention_matches_reference_with_repeated_kv():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 10, 6, 8)).astype(np.float32)
    k = rng.standard_normal((2, 10, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 10, 2, 8)).astype(np.float32)
    got = naive_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    want = attention_reference(q, np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gqa_model_equals_mha_with_repeated_kv_weights():
    gqa_cfg = tiny(dtype="float32", num_kv_heads=2)
    mha_cfg = dataclasses.replace(gqa_cfg, num_kv_heads=4)
    gqa, mha = build(gqa_cfg), build(mha_cfg, seed=1)
    params = nnx.state(gqa).to_pure_dict()
    mha_params = jax.tree.map(lambda x: x, params)
    hd, nh, nkv = 16, 4, 2
    for i in ("0", "1"):
        w = params["layers"][i]["attn"]["qkv"]["kernel"]
        wq, wk, wv = jnp.split(w, [nh * hd, (nh + nkv) * hd], axis=1)

        def repeat(w_kv):
            return jnp.repeat(w_kv.reshape(64, nkv, hd), nh // nkv, axis=1).reshape(64, nh * hd)

        mha_params["layers"][i]["attn"]["qkv"]["kernel"] = jnp.concatenate(
            [wq, repeat(wk), repeat(wv)], axis=1
        )
    nnx.update(mha, mha_params)
    x = tokens((2, 12))
    np.testing.assert_allclose(run(gqa, x), run(mha, x), rtol=1e-5, atol=1e-5)


def test_quantized_forward_runs_with_key():
    cfg = tiny()
    model = build(cfg, recipe="nvfp4")
    logits = run(model, tokens((2, 16)), jax.random.key(3))
    assert logits.shape == (2, 16, 256) and bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 72, "num_heads": 4}, "d_model must be a multiple of 16"),
        ({"mlp_dim": 100}, "mlp_dim must be a multiple of 16"),
        ({"num_kv_heads": 3}, "num_kv_heads must be a divisor of num_heads=4"),
        ({"num_heads": 3, "num_kv_heads": 1}, "num_heads must be a divisor of d_model=64"),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"dtype": "float8"}, "model.dtype must be one of"),
        ({"num_layers": 0}, "model.num_layers must be > 0"),
        ({"vocab_size": -1}, "model.vocab_size must be >= 0"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_vocab_size_from_data():
    # filling model.vocab_size from the data: test_step.py::test_with_vocab_size_fills_from_data
    with pytest.raises(ValueError, match="vocab_size must be > 0 to build"):
        build(tiny(vocab_size=0))


def test_recipes_must_cover_every_linear():
    cfg = tiny()
    recipes = dict.fromkeys(linear_paths(cfg)[1:], nvfp4_ops.get_recipe("bf16"))
    with pytest.raises(ValueError, match="missing \\['layers.0.attn.qkv'\\]"):
        Llama(cfg, recipes, rngs=nnx.Rngs(0))


def test_sequence_longer_than_max_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len=32"):
        run(build(tiny()), tokens((1, 33)))
