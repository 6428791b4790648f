"""Llama-family decoder in Flax NNX whose block linears run through `nvfp4_ops.dot_general`.

Parameter tree (float32 master weights; kernels [in, out]):
    embed.embedding                 [vocab, d_model]
    layers.{i}.attn_norm.scale      [d_model]
    layers.{i}.attn.qkv.kernel      [d_model, (num_heads + 2 * num_kv_heads) * head_dim]  q|k|v
    layers.{i}.attn.o.kernel        [num_heads * head_dim, d_model]
    layers.{i}.mlp_norm.scale       [d_model]
    layers.{i}.mlp.gate_up.kernel   [d_model, 2 * mlp_dim]                                gate|up
    layers.{i}.mlp.down.kernel      [mlp_dim, d_model]
    final_norm.scale                [d_model]
    lm_head.kernel                  [d_model, vocab]   (absent when tie_embeddings)
Layer indices `i` are string keys "0", "1", ... in the parameter dict.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.layers import Block, RMSNorm

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
LINEAR_NAMES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
"""The quantizable linears of each block, in the order their SR keys are derived (0..3)."""


def _check(ok: bool, key: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"model.{key} must be {expected}, got {actual!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the Llama decoder.

    Attributes:
        vocab_size: Vocabulary size; 0 means "take it from the data" (see `with_vocab_size`).
        d_model: Residual width; a multiple of 16 (NVFP4 blocks are 16 wide).
        num_layers: Number of decoder blocks.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention); must divide `num_heads`.
        head_dim: Per-head width; 0 means `d_model // num_heads`. Must be even (RoPE).
        mlp_dim: SwiGLU hidden width; a multiple of 16.
        max_seq_len: Longest sequence the model accepts.
        rope_theta: RoPE base frequency.
        rms_norm_eps: RMSNorm epsilon.
        tie_embeddings: Use the embedding matrix as the output head.
        init_std: Std of the normal init; `attn.o` and `mlp.down` use init_std / sqrt(2 * num_layers).
        dtype: Compute dtype: "bfloat16", "float32" or "float16" (parameters stay float32).

    Example:
        >>> ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ...             mlp_dim=128).resolved_head_dim
        16
    """

    vocab_size: int = 0
    d_model: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0
    mlp_dim: int = 768
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in (
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "mlp_dim",
            "max_seq_len",
        ):
            _check(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        _check(self.vocab_size >= 0, "vocab_size", ">= 0 (0 = take from data)", self.vocab_size)
        _check(self.head_dim >= 0, "head_dim", ">= 0 (0 = d_model // num_heads)", self.head_dim)
        _check(self.dtype in _DTYPES, "dtype", f"one of {sorted(_DTYPES)}", self.dtype)
        _check(self.rope_theta > 0, "rope_theta", "> 0", self.rope_theta)
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "> 0", self.rms_norm_eps)
        _check(self.init_std > 0, "init_std", "> 0", self.init_std)
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"a divisor of num_heads={self.num_heads}",
            self.num_kv_heads,
        )
        if self.head_dim == 0:
            _check(
                self.d_model % self.num_heads == 0,
                "num_heads",
                f"a divisor of d_model={self.d_model} when head_dim=0",
                self.num_heads,
            )
        hd = self.resolved_head_dim
        _check(hd % 2 == 0, "head_dim", "even (RoPE rotates pairs)", hd)
        widths = {
            "d_model": self.d_model,
            "mlp_dim": self.mlp_dim,
            "num_heads * head_dim": self.num_heads * hd,
            "(num_heads + 2 * num_kv_heads) * head_dim": (self.num_heads + 2 * self.num_kv_heads)
            * hd,
        }
        for name, width in widths.items():
            _check(width % 16 == 0, name, "a multiple of 16 (NVFP4 blocks are 16 wide)", width)

    @property
    def resolved_head_dim(self) -> int:
        """`head_dim`, or `d_model // num_heads` when it is 0."""
        return self.head_dim or self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The compute dtype as a JAX dtype."""
        return _DTYPES[self.dtype]

    def with_vocab_size(self, data_vocab_size: int) -> ModelConfig:
        """Returns the config with the data's vocabulary filled in.

        `vocab_size=0` takes the data's size; an explicit size must be >= the data's (a larger one
        pads the embedding, e.g. to a multiple of 128).
        """
        if data_vocab_size <= 0:
            raise ValueError(f"data_vocab_size must be > 0, got {data_vocab_size}")
        if self.vocab_size == 0:
            return dataclasses.replace(self, vocab_size=data_vocab_size)
        if self.vocab_size < data_vocab_size:
            raise ValueError(
                f"model.vocab_size must be 0 (take from data) or >= the data's vocabulary "
                f"size {data_vocab_size}, got {self.vocab_size}"
            )
        return self


def linear_paths(cfg: ModelConfig) -> list[str]:
    """Module paths of every quantizable linear, e.g. `layers.0.attn.qkv`, in model order."""
    return [f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in LINEAR_NAMES]


class Llama(nnx.Module):
    """The decoder. `recipes` maps every path of `linear_paths(cfg)` to an `nvfp4_ops.Recipe`;
    every quantized linear runs on `backend` (`nvfp4_ops.dot_general`'s argument).

    Example:
        >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4,
        ...                   num_kv_heads=2, mlp_dim=128)
        >>> bf16 = nvfp4_ops.get_recipe("bf16")
        >>> model = Llama(cfg, {p: bf16 for p in linear_paths(cfg)}, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 8), jnp.int32)).shape
        (2, 8, 256)
    """

    def __init__(
        self,
        cfg: ModelConfig,
        recipes: dict[str, nvfp4_ops.Recipe],
        *,
        rngs: nnx.Rngs,
        backend: str | tuple[str, ...] = "auto",
    ):
        if cfg.vocab_size <= 0:
            raise ValueError(
                "model.vocab_size must be > 0 to build the model, got 0; fill it from the data "
                "with ModelConfig.with_vocab_size(datasets.vocab_size)"
            )
        expected = set(linear_paths(cfg))
        missing, extra = sorted(expected - set(recipes)), sorted(set(recipes) - expected)
        if missing or extra:
            raise ValueError(
                f"recipes must cover exactly the linears; missing {missing}, extra {extra}"
            )
        dtype, init = cfg.compute_dtype, jax.nn.initializers.normal(stddev=cfg.init_std)
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, embedding_init=init, rngs=rngs
        )
        self.layers = nnx.Dict(
            {
                str(i): Block(cfg, recipes, i, rngs=rngs, backend=backend)
                for i in range(cfg.num_layers)
            }
        )
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, kernel_init=init,
                preferred_element_type=jnp.float32, rngs=rngs,
            )  # fmt: skip

    def __call__(self, inputs_BxL: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Returns float32 logits [B, L, vocab].

        Args:
            inputs_BxL: int token ids.
            key: The step's stochastic-rounding key; linear j of layer i gets
                `fold_in(fold_in(key, i), j)` (j in `LINEAR_NAMES` order). None passes no key
                (fine for recipes without stochastic rounding, and for the forward-only BF16 path).
        """
        if inputs_BxL.ndim != 2 or inputs_BxL.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"inputs must be [batch, length] with length <= model.max_seq_len="
                f"{self.cfg.max_seq_len}, got shape {inputs_BxL.shape}"
            )
        x_BxLxD = self.embed(inputs_BxL)
        for i in range(self.cfg.num_layers):
            x_BxLxD = self.layers[str(i)](x_BxLxD, _layer_keys(key, i))
        x_BxLxD = self.final_norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            emb_VxD = self.embed.embedding[...].astype(x_BxLxD.dtype)
            return jnp.einsum("bld,vd->blv", x_BxLxD, emb_VxD, preferred_element_type=jnp.float32)
        return self.lm_head(x_BxLxD).astype(jnp.float32)


def linear_keys(cfg: ModelConfig, key: jax.Array | None) -> dict[str, jax.Array | None]:
    """The stochastic-rounding key each linear gets from `Llama.__call__(..., key=key)`, by path."""
    keys = {}
    for i in range(cfg.num_layers):
        for name, linear_key in zip(LINEAR_NAMES, _layer_keys(key, i), strict=True):
            keys[f"layers.{i}.{name}"] = linear_key
    return keys


def _layer_keys(key: jax.Array | None, layer: int) -> tuple[jax.Array | None, ...]:
    if key is None:
        return (None,) * len(LINEAR_NAMES)
    layer_key = jax.random.fold_in(key, layer)
    return tuple(jax.random.fold_in(layer_key, j) for j in range(len(LINEAR_NAMES)))
