"""Recipes: which element format, block shape and rounding each tensor role gets in each GEMM.

A linear layer Y = X W runs three GEMMs per training step (spec section 3):

| GEMM  | operands                         | role settings used                                   |
|-------|----------------------------------|------------------------------------------------------|
| Fprop | X, W                             | `fprop_input` (1D along K), `fprop_weight`           |
| Dgrad | dY, W                            | `grad` (1D along N), W: the Fprop quantization when  |
|       |                                  | it is 2D or per-tensor, else re-quantized along N    |
| Wgrad | X^T, dY^T (contract over tokens) | `fprop_input` and `grad`, 1D along the tokens, after |
|       |                                  | the random Hadamard transform if `wgrad_hadamard`    |

`Recipe` objects are frozen and hashable, so they can be static arguments of `jax.jit` and keys of
dicts (one per layer).

`Recipe.bf16_fprop` runs the Fprop GEMM on the unquantized operands while Dgrad and Wgrad stay
quantized (NVFP4 paper, Appendix D: switching the forward to BF16 for the last part of training
recovers most of the remaining loss gap); `Recipe.with_bf16_fprop()` derives such a recipe.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from nvfp4_ops.formats import FORMAT_OPS

FORMATS = tuple(FORMAT_OPS)
"""Element formats ("nvfp4", "mxfp4", "fp8_e4m3", "fp8_e5m2", "bf16": the keys of
`nvfp4_ops.formats.FORMAT_OPS`). "bf16" means no quantization: the operand is used as given."""

ROUNDINGS = ("rne", "stochastic")

_STOCHASTIC_FORMATS = " and ".join(repr(f) for f, ops in FORMAT_OPS.items() if ops.stochastic)


@dataclasses.dataclass(frozen=True)
class TensorQuant:
    """How one tensor role is quantized.

    Attributes:
      fmt: one of `FORMATS`. "bf16" = no quantization (the operand is used as given).
      block_shape: (1, 16) or (16, 16) for "nvfp4" ((16, 16) only for the weight role), (1, 32) for
        "mxfp4", None for FP8 (per-tensor current scaling) and "bf16".
      rounding: "rne" or "stochastic" (FP4 formats only).
    """

    fmt: str = "nvfp4"
    block_shape: tuple[int, int] | None = (1, 16)
    rounding: str = "rne"

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        block = None if self.block_shape is None else tuple(self.block_shape)
        object.__setattr__(self, "block_shape", block)
        blocks = FORMAT_OPS[self.fmt].block_shapes
        if block not in blocks:
            raise ValueError(
                f"block_shape for fmt={self.fmt!r} must be one of {blocks}, got {block}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "stochastic" and not FORMAT_OPS[self.fmt].stochastic:
            raise ValueError(
                f"rounding='stochastic' is implemented for fmt {_STOCHASTIC_FORMATS} only, "
                f"got fmt={self.fmt!r}"
            )

    @property
    def quantized(self) -> bool:
        """False for "bf16" (the operand passes through unchanged)."""
        return FORMAT_OPS[self.fmt].quantized

    @property
    def block_size(self) -> int:
        """Elements per block along the contraction axis (1 for per-tensor or no scaling)."""
        return 1 if self.block_shape is None else self.block_shape[1]

    @property
    def is_2d(self) -> bool:
        """True for 16x16 tiles (the same quantized values serve both orientations)."""
        return self.block_shape == (16, 16)


BF16 = TensorQuant("bf16", None)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Per-role quantization settings of a quantized `dot_general` (spec section 3).

    Attributes:
      fprop_input: the activations X (Fprop along K; Wgrad along the tokens, after the RHT).
      fprop_weight: the weight W (Fprop; reused in Dgrad when 2D or per-tensor).
      grad: the output gradient dY (Dgrad along N; Wgrad along the tokens, after the RHT).
      wgrad_hadamard: apply the 16-point random Hadamard transform to both Wgrad operands along the
        token dimension before quantizing them (amax taken after the rotation).
      hadamard_size: size of the Hadamard tiles (a power of two; 16 in the paper).
      name: a label for logs and tables (not used in the math).
      bf16_fprop: run the Fprop GEMM on the unquantized operands (a plain `dot_general` in the
        operands' dtype with FP32 accumulation, as the "bf16" preset does) while Dgrad and Wgrad
        are unchanged: W is still quantized in the forward pass as Dgrad uses it, x^T is still
        rotated and quantized for Wgrad, with the same stochastic-rounding key slots, so the
        gradients are bit-identical to those of the same recipe without the flag. Build it with
        `with_bf16_fprop()`.

    Example:
      >>> r = Recipe(grad=TensorQuant("nvfp4", (1, 16), "stochastic"))
      >>> r.needs_key
      True
    """

    fprop_input: TensorQuant = TensorQuant("nvfp4", (1, 16), "rne")
    fprop_weight: TensorQuant = TensorQuant("nvfp4", (16, 16), "rne")
    grad: TensorQuant = TensorQuant("nvfp4", (1, 16), "stochastic")
    wgrad_hadamard: bool = True
    hadamard_size: int = 16
    name: str = "custom"
    bf16_fprop: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bf16_fprop, bool):
            raise TypeError(f"Recipe.bf16_fprop must be a bool, got {self.bf16_fprop!r}")
        for role in ("fprop_input", "fprop_weight", "grad"):
            tq = getattr(self, role)
            if not isinstance(tq, TensorQuant):
                raise TypeError(f"Recipe.{role} must be a TensorQuant, got {type(tq).__name__}")
        for role in ("fprop_input", "grad"):
            if getattr(self, role).is_2d:
                raise ValueError(
                    f"Recipe.{role}: 16x16 blocks are for the weight only (activations and "
                    f"gradients are quantized 1D along the contraction), got {getattr(self, role)}"
                )
        size = self.hadamard_size
        if not isinstance(size, int) or size < 2 or size & (size - 1):
            raise ValueError(f"hadamard_size must be a power of two >= 2, got {size!r}")
        if self.wgrad_hadamard and not (self.fprop_input.quantized or self.grad.quantized):
            raise ValueError(
                "wgrad_hadamard=True needs a quantized Wgrad operand (fprop_input or grad), "
                "got both 'bf16'"
            )

    @property
    def quantized(self) -> bool:
        """False when no role is quantized (plain `lax.dot_general`, plain autodiff)."""
        return any(t.quantized for t in (self.fprop_input, self.fprop_weight, self.grad))

    @property
    def needs_key(self) -> bool:
        """True when some role uses stochastic rounding (a PRNG key must then be passed)."""
        return any(
            t.rounding == "stochastic" for t in (self.fprop_input, self.fprop_weight, self.grad)
        )

    @property
    def alignment(self) -> int:
        """Multiple that M, K and N are zero-padded to (blocks and Hadamard tiles)."""
        sizes = [t.block_size for t in (self.fprop_input, self.fprop_weight, self.grad)]
        sizes += [16 if self.fprop_weight.is_2d else 1]
        sizes += [self.hadamard_size if self.wgrad_hadamard else 1]
        return max(sizes)

    def with_bf16_fprop(self) -> Recipe:
        """This recipe with its Fprop GEMM in BF16 (`bf16_fprop=True`, name "<name>+bf16-fprop").

        A recipe that quantizes nothing, or that already has the flag, is returned unchanged.

        Example:
          >>> get_recipe("nvfp4").with_bf16_fprop().name
          'nvfp4+bf16-fprop'
        """
        if not self.quantized or self.bf16_fprop:
            return self
        return dataclasses.replace(self, bf16_fprop=True, name=f"{self.name}+bf16-fprop")


_NV_X = TensorQuant("nvfp4", (1, 16), "rne")
_NV_W2D = TensorQuant("nvfp4", (16, 16), "rne")
_NV_W1D = TensorQuant("nvfp4", (1, 16), "rne")
_NV_G_SR = TensorQuant("nvfp4", (1, 16), "stochastic")
_NV_G_RNE = TensorQuant("nvfp4", (1, 16), "rne")
_MX_RNE = TensorQuant("mxfp4", (1, 32), "rne")
_MX_SR = TensorQuant("mxfp4", (1, 32), "stochastic")

RECIPES: MappingProxyType[str, Recipe] = MappingProxyType(
    {
        "nvfp4": Recipe(_NV_X, _NV_W2D, _NV_G_SR, True, name="nvfp4"),
        "nvfp4-no-rht": Recipe(_NV_X, _NV_W2D, _NV_G_SR, False, name="nvfp4-no-rht"),
        "nvfp4-no-sr": Recipe(_NV_X, _NV_W2D, _NV_G_RNE, True, name="nvfp4-no-sr"),
        "nvfp4-no-2d": Recipe(_NV_X, _NV_W1D, _NV_G_SR, True, name="nvfp4-no-2d"),
        "nvfp4-naive": Recipe(_NV_X, _NV_W1D, _NV_G_RNE, False, name="nvfp4-naive"),
        "mxfp4": Recipe(_MX_RNE, _MX_RNE, _MX_SR, True, name="mxfp4"),
        "fp8": Recipe(
            TensorQuant("fp8_e4m3", None),
            TensorQuant("fp8_e4m3", None),
            TensorQuant("fp8_e5m2", None),
            False,
            name="fp8",
        ),
        "bf16": Recipe(BF16, BF16, BF16, False, name="bf16"),
    }
)
"""Presets. "nvfp4" is the paper's recipe (TE's `NVFP4BlockScaling` default); "mxfp4" uses the
OCP scale rule with the same stochastic rounding and RHT; "fp8" is per-tensor current scaling
(E4M3 forward, E5M2 gradients); "bf16" quantizes nothing."""


def get_recipe(name: str) -> Recipe:
    """Return the preset called `name` (see `RECIPES`).

    Example:
      >>> get_recipe("nvfp4").fprop_weight.block_shape
      (16, 16)
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {sorted(RECIPES)}")
    return RECIPES[name]
