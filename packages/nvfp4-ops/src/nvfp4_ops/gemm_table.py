"""The operands of a linear layer's three GEMMs, each described once (`OPERANDS`, `GEMM_SPECS`).

y = x . w with x [B, M, K], w [B, K, N] and dY [B, M, N]; every GEMM contracts the LAST axis of
both its operands ([B, P, C] . [B, Q, C] -> [B, P, Q]):

| GEMM  | operand (= key slot) | tensor, as contracted | `Recipe` field (default)     | RHT | reuses  |
|-------|----------------------|-----------------------|------------------------------|-----|---------|
| fprop | fprop_x              | x    [M, K]           | fprop_input                  |     |         |
| fprop | fprop_w              | w^T  [N, K]           | fprop_weight                 |     |         |
| dgrad | dgrad_dy             | dY   [M, N]           | grad                         |     |         |
| dgrad | dgrad_w              | w    [K, N]           | dgrad_weight (fprop_weight)  |     | fprop_w |
| wgrad | wgrad_x              | x^T  [K, M]           | wgrad_input (fprop_input)    | yes |         |
| wgrad | wgrad_dy             | dY^T [N, M]           | wgrad_grad (grad)            | yes |         |

(RHT: the recipe's random Hadamard transform along the tokens when `wgrad_hadamard`.) A 16x16-tiled
or per-tensor (or unquantized) weight has the same values in both orientations, so Dgrad reuses
the Fprop quantization, transposed, with its key, when its settings are the Fprop ones; a 1D
weight (or one with its own `dgrad_weight`) is re-quantized along N. With `Recipe.bf16_fprop`
the Fprop GEMM runs on the unquantized operands.

`nvfp4_ops.qdot` (the custom_vjp that training runs) and `nvfp4_ops.telemetry` (the statistics of
those quantizations) both read this table, through `operand_quants(recipe)` and
`quantizations(recipe)`, so the statistics describe exactly the quantizations training runs.
Stochastic-rounding keys: `split_keys(key)` gives one key per operand, in table order
(`KEY_SLOTS`); `require_key` is the one missing-key check.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.hadamard import hadamard_transform
from nvfp4_ops.recipe import Recipe, TensorQuant


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """One operand of one GEMM (a row of the table in the module docstring).

    Attributes:
      name: the operand's role name, also its stochastic-rounding key slot ("fprop_x", ...).
      gemm: "fprop", "dgrad" or "wgrad".
      tensor: "x" [B, M, K], "w" [B, K, N] or "dy" [B, M, N].
      setting: the `Recipe` role holding its `TensorQuant` (`Recipe.setting` resolves defaults).
      transposed: the tensor's last two axes are swapped first (the contraction axis is then last).
      rotated: the recipe's RHT (when `Recipe.wgrad_hadamard`) applies along the contraction.
      shares: the operand whose quantization this one reuses, transposed, when that one has the
        same values in both orientations (16x16 tiles, per-tensor or no scaling).
    """

    name: str
    gemm: str
    tensor: str
    setting: str
    transposed: bool = False
    rotated: bool = False
    shares: str | None = None


OPERANDS: MappingProxyType[str, OperandSpec] = MappingProxyType(
    {
        s.name: s
        for s in (
            OperandSpec("fprop_x", "fprop", "x", "fprop_input"),
            OperandSpec("fprop_w", "fprop", "w", "fprop_weight", transposed=True),
            OperandSpec("dgrad_dy", "dgrad", "dy", "grad"),
            OperandSpec("dgrad_w", "dgrad", "w", "dgrad_weight", shares="fprop_w"),
            OperandSpec("wgrad_x", "wgrad", "x", "wgrad_input", transposed=True, rotated=True),
            OperandSpec("wgrad_dy", "wgrad", "dy", "wgrad_grad", transposed=True, rotated=True),
        )
    }
)
"""{operand name: OperandSpec}, in stochastic-rounding key order."""


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """One GEMM: (lhs, rhs) operand names, and the `Recipe` flag that runs it unquantized."""

    name: str
    lhs: str
    rhs: str
    unquantized_if: str | None = None


GEMM_SPECS: MappingProxyType[str, GemmSpec] = MappingProxyType(
    {
        "fprop": GemmSpec("fprop", "fprop_x", "fprop_w", unquantized_if="bf16_fprop"),
        "dgrad": GemmSpec("dgrad", "dgrad_dy", "dgrad_w"),
        "wgrad": GemmSpec("wgrad", "wgrad_x", "wgrad_dy"),
    }
)

KEY_SLOTS = tuple(OPERANDS)
"""Stochastic-rounding key slots: `split_keys(key)` gives one key per slot, in this order."""


@dataclasses.dataclass(frozen=True)
class OperandQuant:
    """One table operand as one recipe quantizes it.

    Attributes:
      spec: the table row.
      tq: its settings (`recipe.setting(spec.setting)`).
      hadamard_size: size of the RHT applied before quantizing it, None for none.
      reuses: the operand whose quantization this one is (transposed), or None.
    """

    spec: OperandSpec
    tq: TensorQuant
    hadamard_size: int | None
    reuses: str | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def key_slot(self) -> str:
        """The `KEY_SLOTS` entry of the key its quantization draws (the reused operand's)."""
        return self.reuses or self.spec.name


def same_both_ways(tq: TensorQuant) -> bool:
    """Whether an operand quantized per `tq` has the same values transposed (16x16 tiles,
    per-tensor or no scaling), so that another GEMM can reuse it."""
    return tq.is_2d or tq.block_shape is None


def operand_quants(recipe: Recipe) -> dict[str, OperandQuant]:
    """Every table operand as `recipe` quantizes it, in table order."""
    out = {}
    for spec in OPERANDS.values():
        tq = recipe.setting(spec.setting)
        rotate = spec.rotated and recipe.wgrad_hadamard
        shared = spec.shares and recipe.setting(OPERANDS[spec.shares].setting)
        reuses = spec.shares if shared == tq and same_both_ways(tq) else None
        out[spec.name] = OperandQuant(spec, tq, recipe.hadamard_size if rotate else None, reuses)
    return out


def gemm_quantized(recipe: Recipe, gemm: str) -> bool:
    """Whether `recipe` runs GEMM `gemm` on quantized operands."""
    flag = GEMM_SPECS[gemm].unquantized_if
    return flag is None or not getattr(recipe, flag)


def quantizations(recipe: Recipe) -> dict[str, OperandQuant]:
    """The distinct quantizations one training step of `recipe` computes, by reporting role.

    Each quantized GEMM's operands in table order; an operand that reuses another's quantization
    is left out when that one's GEMM is quantized too (it is the same array), else (Fprop in
    BF16) listed under its own name with the quantization it reuses (that operand's layout and
    key). "bf16" operands are included (their quantization is the identity).
    """
    ops = operand_quants(recipe)
    out = {}
    for gemm in GEMM_SPECS.values():
        if not gemm_quantized(recipe, gemm.name):
            continue
        for name in (gemm.lhs, gemm.rhs):
            reuses = ops[name].reuses
            if reuses is not None and gemm_quantized(recipe, OPERANDS[reuses].gemm):
                continue
            out[name] = ops[reuses or name]
    return out


def wgrad_rotation(x: jax.Array, recipe: Recipe) -> jax.Array:
    """A Wgrad operand [..., tokens] rotated by the recipe's RHT along the tokens (or unchanged).

    The rotation is computed in float32 and then rounded to `x`'s dtype when that is narrower
    (BF16, FP16), before any amax is taken: TransformerEngine's reference quantizer rotates in
    the operand's dtype and its fused kernel (BF16 input only) rounds the same way, so the Wgrad
    codes and scales are TE's bit for bit. A float32 operand stays float32 (TE's kernels have no
    FP32 RHT; its reference then rotates in FP32 too, up to summation order).
    """
    return _rotation(x, recipe.hadamard_size if recipe.wgrad_hadamard else None)


def _rotation(x: jax.Array, size: int | None) -> jax.Array:
    if size is None:
        return x
    rotated = hadamard_transform(x, axis=-1, size=size)
    if jnp.finfo(x.dtype).bits < 32:
        return rotated.astype(x.dtype)
    return rotated


def oriented(op: OperandQuant, tensor: jax.Array) -> jax.Array:
    """The operand's tensor with its contraction axis last (transposed if the table says so)."""
    return jnp.swapaxes(tensor, -1, -2) if op.spec.transposed else tensor


def rotated(op: OperandQuant, oriented_tensor: jax.Array) -> jax.Array:
    """An `oriented` operand rotated by the RHT if the recipe applies it to this operand."""
    return _rotation(oriented_tensor, op.hadamard_size)


def operand_view(op: OperandQuant, tensor: jax.Array) -> jax.Array:
    """The operand as it is quantized: `tensor` oriented, then rotated (x, w or dY [B, ., .])."""
    return rotated(op, oriented(op, tensor))


def split_keys(key: jax.Array | None) -> dict[str, jax.Array | None]:
    """The per-operand stochastic-rounding keys, {slot: key} for the slots of `KEY_SLOTS`."""
    if key is None:
        return dict.fromkeys(KEY_SLOTS)
    return dict(zip(KEY_SLOTS, jax.random.split(key, len(KEY_SLOTS)), strict=True))


def as_key(key: Any, recipe: Recipe) -> jax.Array | None:
    """The stochastic-rounding key argument of a call of `recipe`, checked (`require_key`) and
    typed: a typed PRNG key as is, raw uint32[2] key data wrapped (threefry), None when the
    recipe rounds nothing stochastically and none was given.

    Raises:
      ValueError: no key for a recipe that needs one. TypeError: not a PRNG key.
    """
    require_key(key, recipe)
    if key is None:
        return None
    if not isinstance(key, jax.Array):
        raise TypeError(f"key must be a JAX PRNG key, got {type(key).__name__}")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a PRNG key (typed, or raw uint32[2]), got {key.dtype}{key.shape}")


def require_key(key: Any, settings: Recipe | TensorQuant) -> None:
    """The missing-key check: a ValueError if `settings` round stochastically and `key` is None.

    Example:
      >>> require_key(None, TensorQuant("nvfp4", (1, 16), "rne"))  # round to nearest: no key
    """
    if isinstance(settings, Recipe):
        stochastic, what = settings.needs_key, f"recipe {settings.name!r}"
    else:
        stochastic, what = settings.rounding == "stochastic", str(settings)
    if stochastic and key is None:
        raise ValueError(
            f"{what} uses stochastic rounding and needs a PRNG key, got key=None "
            "(pass key=jax.random.key(...); there is no silent fallback to RNE)"
        )
