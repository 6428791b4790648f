"""Llama-family decoder in Flax NNX whose block linears run through `nvfp4_ops.dot_general`.

Parameter tree (float32 master weights; kernels [in, out]):
    embed.embedding                 [vocab, d_model]
    layers.{i}.attn_norm.scale      [d_model]
    layers.{i}.attn.qkv.kernel      [d_model, (num_heads + 2 * num_kv_heads) * head_dim]  q|k|v
    layers.{i}.attn.qkv.bias        [(num_heads + 2 * num_kv_heads) * head_dim]    (qkv_bias only)
    layers.{i}.attn.q_norm.scale    [head_dim]                                     (qk_norm only)
    layers.{i}.attn.k_norm.scale    [head_dim]                                     (qk_norm only)
    layers.{i}.attn.o.kernel        [num_heads * head_dim, d_model]
    layers.{i}.attn.o.bias          [d_model]                                      (o_bias only)
    layers.{i}.mlp_norm.scale       [d_model]
    layers.{i}.mlp.gate_up.kernel   [d_model, 2 * mlp_dim]                                gate|up
    layers.{i}.mlp.down.kernel      [mlp_dim, d_model]
    final_norm.scale                [d_model]
    lm_head.kernel                  [d_model, vocab]   (absent when tie_embeddings)
Layer indices `i` are string keys "0", "1", ... in the parameter dict. With `scan_layers`, runs of
blocks that compute alike are stored stacked instead (`layers.{first}-{last}...`, a leading layer
axis; see `nvfp4_train.stacking`) and run under `jax.lax.scan`; `remat` recomputes each block's
activations in the backward pass according to a `jax.checkpoint` policy.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.layers import INPUT_AMAX, Block, RMSNorm, sow_input_amax
from nvfp4_train.stacking import LayerLayout, runs_of

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
LINEAR_NAMES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
"""The quantizable linears of each block, in the order their SR keys are derived (0..3)."""
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""The Hugging Face `model_type`s this decoder computes (see `ModelConfig.architecture`)."""
AUTO_SCAN_LAYERS = 8
"""`scan_layers: auto` scans models of at least this many blocks."""
_NAMES = jax.checkpoint_policies.save_only_these_names(nvfp4_ops.RESIDUAL_NAME)
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "quantized": _NAMES,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, _NAMES
    ),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _NAMES
    ),
}
"""`model.remat` -> the `jax.checkpoint` policy of each block (None: no rematerialisation).

full: keep only each block's input, recompute the rest; quantized: also keep the FP4 operands the
quantized linears saved for their backward pass (`nvfp4_ops.RESIDUAL_NAME`) and recompute
everything else (norms, attention, BF16 linears); dots / dots_no_batch: keep the outputs of every
matmul (without batch dimensions) plus those FP4 operands, recompute the elementwise work.
"""


def _check(ok: bool, key: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"model.{key} must be {expected}, got {actual!r}")


ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face's `rope_scaling` / `rope_parameters` say it.

    Attributes:
        rope_type: "default" (none), "linear" (every frequency / `factor`) or "llama3"
            (Llama 3.1/3.2: low frequencies / `factor`, high ones kept, a smooth ramp between).
        factor: the context extension factor.
        low_freq_factor, high_freq_factor: "llama3": the wavelength band
            (`original_max_position_embeddings / factor`) of the ramp.
        original_max_position_embeddings: "llama3": the context the model was pretrained on.
    """

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        key = "rope_scaling"
        _check(self.rope_type in ROPE_TYPES, f"{key}.rope_type", f"one of {ROPE_TYPES}",
               self.rope_type)  # fmt: skip
        _check(self.factor > 0, f"{key}.factor", "> 0", self.factor)
        _check(0 < self.low_freq_factor < self.high_freq_factor, f"{key}.low_freq_factor",
               f"> 0 and < high_freq_factor={self.high_freq_factor}", self.low_freq_factor)  # fmt: skip
        _check(self.original_max_position_embeddings > 0,
               f"{key}.original_max_position_embeddings", "> 0",
               self.original_max_position_embeddings)  # fmt: skip


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
        rope_scaling: RoPE frequency scaling (`RopeScaling`; Llama 3.1 / 3.2 use "llama3").
        qkv_bias: q, k and v projections have biases (Qwen 2; Llama/Qwen 3 `attention_bias`).
        o_bias: the output projection has a bias (Llama/Qwen 3 `attention_bias`).
        qk_norm: RMSNorm over each head's q and k before RoPE, one [head_dim] scale each (Qwen 3).
        architecture: the Hugging Face `model_type` the model is exported as ("llama",
            "mistral", "qwen2", "qwen3"; `ARCHITECTURES`); the bias and norm options must be
            ones it can express (e.g. qwen2: q/k/v biases and no o bias).
        init_from: a Hugging Face model directory (`config.json`, safetensors weights,
            `tokenizer.json`) to start from instead of a random init. The config loader fills
            this section from its `config.json` (`nvfp4_train.hf_config`); a fresh run reads
            its weights (`nvfp4_train.hf_weights`), a resumed one its checkpoint.
        init_std: Std of the normal init; `attn.o` and `mlp.down` use init_std / sqrt(2 * num_layers).
        dtype: Compute dtype: "bfloat16", "float32" or "float16" (parameters stay float32).
        scan_layers: Store each run of >= 2 consecutive blocks with the same recipes stacked and
            run it under `jax.lax.scan` (compile time then hardly grows with depth): true, false,
            or "auto" (scan from `AUTO_SCAN_LAYERS` blocks on). Checkpoints stay per-layer, so a
            run may resume with another setting.
        remat: Rematerialisation of each block in the backward pass: "none", "full",
            "quantized", "dots" or "dots_no_batch" (`REMAT_POLICIES`). It changes memory and
            time, never the numbers.

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
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    architecture: Literal["llama", "mistral", "qwen2", "qwen3"] = "llama"
    init_from: str = ""
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"
    scan_layers: bool | Literal["auto"] = "auto"
    remat: Literal["none", "full", "quantized", "dots", "dots_no_batch"] = "none"

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
        _check(self.scan_layers in (True, False, "auto"), "scan_layers", "true, false or 'auto'",
               self.scan_layers)  # fmt: skip
        _check(self.remat in REMAT_POLICIES, "remat", f"one of {list(REMAT_POLICIES)}", self.remat)
        _check(self.architecture in ARCHITECTURES, "architecture", f"one of {ARCHITECTURES}",
               self.architecture)  # fmt: skip
        _check_architecture(self)
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
    def scans(self) -> bool:
        """Whether runs of alike blocks are stacked and scanned (`scan_layers`, "auto" resolved)."""
        if self.scan_layers == "auto":
            return self.num_layers >= AUTO_SCAN_LAYERS
        return bool(self.scan_layers)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The compute dtype as a JAX dtype."""
        return _DTYPES[self.dtype]


def _check_architecture(cfg: ModelConfig) -> None:
    """Raises ValueError unless `cfg.architecture` can express the bias and norm options."""
    options = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "qk_norm": cfg.qk_norm}
    allowed = {  # what each Hugging Face model class builds
        "llama": [{"qkv_bias": b, "o_bias": b, "qk_norm": False} for b in (False, True)],
        "mistral": [{"qkv_bias": False, "o_bias": False, "qk_norm": False}],
        "qwen2": [{"qkv_bias": True, "o_bias": False, "qk_norm": False}],
        "qwen3": [{"qkv_bias": b, "o_bias": b, "qk_norm": True} for b in (False, True)],
    }[cfg.architecture]
    if options not in allowed:
        raise ValueError(
            f"model.architecture={cfg.architecture!r} builds {' or '.join(map(str, allowed))}; "
            f"got {options}"
        )


def block_params(cfg: ModelConfig) -> tuple[str, ...]:
    """Every parameter of a block, relative to `layers.{i}`, in tree order."""
    attn = ["attn.qkv.kernel", "attn.o.kernel"]
    attn += ["attn.qkv.bias"] * cfg.qkv_bias + ["attn.o.bias"] * cfg.o_bias
    attn += ["attn.q_norm.scale", "attn.k_norm.scale"] * cfg.qk_norm
    mlp = ["mlp.gate_up.kernel", "mlp.down.kernel"]
    return ("attn_norm.scale", *attn, "mlp_norm.scale", *mlp)


def linear_paths(cfg: ModelConfig) -> list[str]:
    """Module paths of every quantizable linear, e.g. `layers.0.attn.qkv`, in model order."""
    return [f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in LINEAR_NAMES]


def layer_layout(
    cfg: ModelConfig, recipes: dict[str, nvfp4_ops.Recipe], no_decay: Sequence[str] = ()
) -> LayerLayout:
    """Which blocks are stacked: with `cfg.scans`, every run of >= 2 consecutive blocks whose
    four linears have the same recipes and whose parameters match the same `no_decay` patterns
    (the optimizer's weight-decay exclusions, searched in `layers.{i}.attn_norm.scale` etc.)."""
    if not cfg.scans:
        return LayerLayout(cfg.num_layers)
    patterns = [re.compile(p) for p in no_decay]

    def signature(i: int) -> tuple:
        decays = tuple(
            any(p.search(f"layers.{i}.{leaf}") for p in patterns) for leaf in block_params(cfg)
        )
        return tuple(recipes[f"layers.{i}.{name}"] for name in LINEAR_NAMES), decays

    return LayerLayout(cfg.num_layers, runs_of([signature(i) for i in range(cfg.num_layers)]))


def _stacked(blocks: list[Block]) -> Block:
    """One Block whose variables are those of `blocks` stacked along a new leading axis."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.split(block)[1] for block in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def _resow(module: nnx.Module, sown: dict[str, Any]) -> None:
    """Sows the `INPUT_AMAX` values of `sown` (a pure dict as a block's capture returns it) on
    the same submodules of `module` (scalars, or one per layer for a stacked block)."""
    for name, value in sown.items():
        if name == INPUT_AMAX:
            sow_input_amax(module, value)
        else:
            _resow(getattr(module, name), value)


def _block_fn(graphdef: nnx.GraphDef, policy: Any):
    """`f(params, rest, x, keys) -> (y, sown input amax)`: one block as a pure function, under
    `jax.checkpoint(policy=policy)` when a policy is given."""

    def apply(params, rest, x_BxLxD, keys):
        block = nnx.merge(graphdef, params, rest)
        y, sown = nnx.capture(block, nnx.Intermediate)(x_BxLxD, keys)
        return y, nnx.to_pure_dict(sown)

    return apply if policy is None else jax.checkpoint(apply, policy=policy)


class Llama(nnx.Module):
    """The decoder. `recipes` maps every path of `linear_paths(cfg)` to an `nvfp4_ops.Recipe`;
    every quantized linear runs on `backend` (`nvfp4_ops.dot_general`'s argument). `layout` says
    which blocks are stacked (default `layer_layout(cfg, recipes)`); it must fit the recipes.

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
        layout: LayerLayout | None = None,
    ):
        if cfg.vocab_size <= 0:
            raise ValueError(
                "model.vocab_size must be > 0 to build the model, got 0; fill it from the data "
                "with nvfp4_train.with_vocab_size(cfg, datasets.vocab_size)"
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
        self.layout = layer_layout(cfg, recipes) if layout is None else layout
        if self.layout.num_layers != cfg.num_layers:
            raise ValueError(
                f"layout is of {self.layout.num_layers} blocks, the model has {cfg.num_layers}"
            )
        for start, stop in self.layout.runs:
            differ = [
                f"layers.{i}.{n}" for i in range(start + 1, stop) for n in LINEAR_NAMES
                if recipes[f"layers.{i}.{n}"] != recipes[f"layers.{start}.{n}"]
            ]  # fmt: skip
            if differ:
                raise ValueError(f"layout stacks blocks {start}..{stop - 1}, but {differ} differ")
        # built one by one in any layout, so that a seed gives the same weights stacked or not
        blocks = [Block(cfg, recipes, i, rngs=rngs, backend=backend) for i in range(cfg.num_layers)]
        self.layers = nnx.Dict(
            {
                key: blocks[start] if stop - start == 1 else _stacked(blocks[start:stop])
                for key, start, stop in self.layout.entries
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
        policy = REMAT_POLICIES[self.cfg.remat]
        for name, start, stop in self.layout.entries:
            block = self.layers[name]
            if stop - start == 1 and policy is None:
                x_BxLxD = block(x_BxLxD, _layer_keys(key, start))
                continue
            graphdef, params, rest = nnx.split(block, nnx.Param, ...)
            apply = _block_fn(graphdef, policy)
            if stop - start == 1:
                x_BxLxD, sown = apply(params, rest, x_BxLxD, _layer_keys(key, start))
            else:
                x_BxLxD, sown = _scan(apply, params, rest, x_BxLxD, key, start, stop)
            _resow(block, sown)
        x_BxLxD = self.final_norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            emb_VxD = self.embed.embedding[...].astype(x_BxLxD.dtype)
            return jnp.einsum("bld,vd->blv", x_BxLxD, emb_VxD, preferred_element_type=jnp.float32)
        return self.lm_head(x_BxLxD).astype(jnp.float32)


def unstacked(model: Llama) -> Llama:
    """A copy of `model` with one Block per layer (its stacked blocks split, their parameters
    slices of the stacked ones) and no remat: the model as telemetry's capture mode sees it.
    An unstacked model is copied as it is."""
    copy = nnx.merge(*nnx.split(model))
    if not copy.layout.scanned and copy.cfg.remat == "none":
        return copy
    layers = {}
    for key, start, stop in copy.layout.entries:
        if stop - start == 1:
            layers[key] = copy.layers[key]
            continue
        graphdef, state = nnx.split(copy.layers[key])
        for j in range(stop - start):
            layers[str(start + j)] = nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state))
    copy.layers = nnx.Dict(layers)
    copy.layout = LayerLayout(copy.cfg.num_layers)
    copy.cfg = dataclasses.replace(copy.cfg, scan_layers=False, remat="none")
    return copy


def linear_keys(cfg: ModelConfig, key: jax.Array | None) -> dict[str, jax.Array | None]:
    """The stochastic-rounding key each linear gets from `Llama.__call__(..., key=key)`, by path."""
    keys = {}
    for i in range(cfg.num_layers):
        for name, linear_key in zip(LINEAR_NAMES, _layer_keys(key, i), strict=True):
            keys[f"layers.{i}.{name}"] = linear_key
    return keys


def _scan(apply, params, rest, x_BxLxD, key, start: int, stop: int):
    """Runs the stacked blocks `start` .. `stop - 1` over `x` with `jax.lax.scan`; each gets the
    keys it would get unstacked. Returns (x, sown input amax with a leading layer axis)."""
    if key is None:
        keys = None
    else:  # one batched derivation (fold_in of a traced index is the same as of an int)
        keys = jax.vmap(lambda i: jnp.stack(_layer_keys(key, i)))(jnp.arange(start, stop))

    def body(x, xs):
        layer_params, layer_keys = xs
        layer_keys = (None,) * len(LINEAR_NAMES) if layer_keys is None else tuple(layer_keys)
        return apply(layer_params, rest, x, layer_keys)

    return jax.lax.scan(body, x_BxLxD, (params, keys))


def _layer_keys(key: jax.Array | None, layer: int) -> tuple[jax.Array | None, ...]:
    if key is None:
        return (None,) * len(LINEAR_NAMES)
    layer_key = jax.random.fold_in(key, layer)
    return tuple(jax.random.fold_in(layer_key, j) for j in range(len(LINEAR_NAMES)))
