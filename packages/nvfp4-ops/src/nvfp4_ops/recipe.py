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
        "mxfp4" and "mxfp8", None for FP8 (per-tensor current scaling) and "bf16".
      rounding: "rne" or "stochastic" (FP4 formats only).
      block_scale_rule: "max" (each block's amax maps to the format max) or, for "nvfp4",
        "4over6" (Four Over Six: per block the better of amax -> 6 and amax -> 4 by squared
        error, tensor scale amax / (6 * 256); `nvfp4_format.quantize`). The codes and scales are
        standard NVFP4 either way.
      outer_scale: "tensor" (one FP32 decode scale per tensor, the recipe's) or, for "nvfp4" in
        1x16 blocks, "row" (one FP32 decode scale per row of the operand as it is contracted:
        per token for Fprop activations, per feature for their Wgrad transpose, as
        TransformerEngine's row-scaled NVFP4; `nvfp4_format.quantize(outer_scale="row")`).
    """

    fmt: str = "nvfp4"
    block_shape: tuple[int, int] | None = (1, 16)
    rounding: str = "rne"
    block_scale_rule: str = "max"
    outer_scale: str = "tensor"

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
        rules = FORMAT_OPS[self.fmt].block_scale_rules
        if self.block_scale_rule not in rules:
            raise ValueError(
                f"block_scale_rule for fmt={self.fmt!r} must be one of {rules}, "
                f"got {self.block_scale_rule!r}"
            )
        outer = FORMAT_OPS[self.fmt].outer_scales
        if self.outer_scale not in outer:
            raise ValueError(
                f"outer_scale for fmt={self.fmt!r} must be one of {outer}, got {self.outer_scale!r}"
            )
        if self.outer_scale == "row" and self.is_2d:
            raise ValueError(
                "outer_scale='row' needs 1x16 blocks: a 16x16 tile shared by rows with different "
                f"outer scales is no longer the same transposed, got block_shape={self.block_shape}"
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

ROLES = ("fprop_input", "fprop_weight", "grad", "dgrad_weight", "wgrad_input", "wgrad_grad")
"""The `Recipe` fields holding a `TensorQuant` (the last three may be None: see `DEFAULTS_TO`)."""

DEFAULTS_TO = MappingProxyType(
    {
        "fprop_input": "fprop_input",
        "fprop_weight": "fprop_weight",
        "grad": "grad",
        "dgrad_weight": "fprop_weight",
        "wgrad_input": "fprop_input",
        "wgrad_grad": "grad",
    }
)
"""Role -> the role whose settings it takes when it is None (the first three: themselves)."""

OPTIONAL_ROLES = ("dgrad_weight", "wgrad_input", "wgrad_grad")
"""The roles that default to another (`DEFAULTS_TO`): None means "as that one"."""


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
      dgrad_weight: W in Dgrad, re-quantized along N; None (default): as `fprop_weight`, whose
        Fprop quantization Dgrad then reuses when it is 2D or per-tensor.
      wgrad_input: x^T in Wgrad; None (default): as `fprop_input`.
      wgrad_grad: dY^T in Wgrad; None (default): as `grad`.
        (A field equal to the one it defaults to is stored as None, so each recipe has one
        spelling; `compose` builds recipes whose GEMMs come from different presets.)

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
    dgrad_weight: TensorQuant | None = None
    wgrad_input: TensorQuant | None = None
    wgrad_grad: TensorQuant | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bf16_fprop, bool):
            raise TypeError(f"Recipe.bf16_fprop must be a bool, got {self.bf16_fprop!r}")
        for role in ("fprop_input", "fprop_weight", "grad"):
            tq = getattr(self, role)
            if not isinstance(tq, TensorQuant):
                raise TypeError(f"Recipe.{role} must be a TensorQuant, got {type(tq).__name__}")
        for role in OPTIONAL_ROLES:
            default, tq = DEFAULTS_TO[role], getattr(self, role)
            if tq is not None and not isinstance(tq, TensorQuant):
                raise TypeError(
                    f"Recipe.{role} must be a TensorQuant or None, got {type(tq).__name__}"
                )
            if tq == getattr(self, default):
                object.__setattr__(self, role, None)
        for role in ("fprop_input", "grad", "wgrad_input", "wgrad_grad"):
            if self.setting(role).is_2d:
                raise ValueError(
                    f"Recipe.{role}: 16x16 blocks are for the weight only (activations and "
                    f"gradients are quantized 1D along the contraction), got {self.setting(role)}"
                )

        size = self.hadamard_size
        if not isinstance(size, int) or size < 2 or size & (size - 1):
            raise ValueError(f"hadamard_size must be a power of two >= 2, got {size!r}")
        wgrad = (self.setting("wgrad_input"), self.setting("wgrad_grad"))
        if self.wgrad_hadamard and not any(t.quantized for t in wgrad):
            raise ValueError(
                "wgrad_hadamard=True needs a quantized Wgrad operand (wgrad_input or wgrad_grad, "
                "by default fprop_input and grad), got both 'bf16'"
            )

    def setting(self, role: str) -> TensorQuant:
        """The `TensorQuant` of `role` (a field name), defaults resolved.

        Example:
          >>> get_recipe("nvfp4").setting("wgrad_input") == get_recipe("nvfp4").fprop_input
          True
        """
        value = getattr(self, role)
        return getattr(self, DEFAULTS_TO[role]) if value is None else value

    @property
    def settings(self) -> tuple[TensorQuant, ...]:
        """Every role's `TensorQuant`, defaults resolved (fprop_input, fprop_weight, grad,
        dgrad_weight, wgrad_input, wgrad_grad)."""
        return tuple(self.setting(role) for role in ROLES)

    @property
    def quantized(self) -> bool:
        """False when no role is quantized (plain `lax.dot_general`, plain autodiff)."""
        return any(t.quantized for t in self.settings)

    @property
    def needs_key(self) -> bool:
        """True when some role uses stochastic rounding (a PRNG key must then be passed)."""
        return any(t.rounding == "stochastic" for t in self.settings)

    @property
    def alignment(self) -> int:
        """Multiple that M, K and N are zero-padded to (blocks and Hadamard tiles)."""
        sizes = [t.block_size for t in self.settings]
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

    @property
    def fprop_unquantized(self) -> bool:
        """True when the Fprop GEMM runs on the unquantized operands (`bf16_fprop`, or both
        Fprop roles "bf16")."""
        return self.bf16_fprop or not (self.fprop_input.quantized or self.fprop_weight.quantized)


def compose(fprop: Recipe, dgrad: Recipe, wgrad: Recipe, *, name: str | None = None) -> Recipe:
    """One recipe whose Fprop, Dgrad and Wgrad GEMMs are quantized as in three recipes.

    Fprop takes `fprop`'s `fprop_input`, `fprop_weight` and `bf16_fprop`; Dgrad `dgrad`'s `grad`
    and Dgrad weight; Wgrad `wgrad`'s Wgrad input and gradient, `wgrad_hadamard` and
    `hadamard_size` (the RHT is dropped when no Wgrad operand is quantized). Three equal recipes
    give that recipe back, and an unquantized Fprop over one recipe R gives exactly
    `R.with_bf16_fprop()` (the W that Dgrad reuses is then quantized in the forward as before,
    with the same keys), so the precision schedule's rules reproduce the presets bit for bit.

    Args:
      fprop, dgrad, wgrad: the recipes each GEMM is taken from.
      name: the label; default "<R>+bf16-fprop" for the case above, else
        "fprop=<F>,dgrad=<D>,wgrad=<W>".

    Example:
      >>> nv, bf = get_recipe("nvfp4"), get_recipe("bf16")
      >>> compose(bf, nv, nv) == nv.with_bf16_fprop()
      True
      >>> compose(nv, bf, nv).setting("grad").fmt, compose(nv, bf, nv).setting("dgrad_weight").fmt
      ('bf16', 'bf16')
    """
    for what, recipe in (("fprop", fprop), ("dgrad", dgrad), ("wgrad", wgrad)):
        if not isinstance(recipe, Recipe):
            raise TypeError(f"compose: {what} must be a Recipe, got {type(recipe).__name__}")
    if fprop == dgrad == wgrad:
        return fprop if name is None else dataclasses.replace(fprop, name=name)
    wgrad_x, wgrad_dy = wgrad.setting("wgrad_input"), wgrad.setting("wgrad_grad")
    hadamard = wgrad.wgrad_hadamard and (wgrad_x.quantized or wgrad_dy.quantized)
    backward = {
        "grad": dgrad.grad,
        "wgrad_grad": wgrad_dy,
        "wgrad_hadamard": hadamard,
        "hadamard_size": wgrad.hadamard_size,
    }
    if fprop.fprop_unquantized and dgrad == wgrad and dgrad.quantized:
        late = dgrad.with_bf16_fprop()
        return late if name is None else dataclasses.replace(late, name=name)
    if fprop.fprop_unquantized:
        # The Fprop settings only serve the backward then: they take the roles that reuse them.
        fields = {
            "fprop_input": wgrad_x,
            "fprop_weight": dgrad.setting("dgrad_weight"),
            "bf16_fprop": True,
        }
    else:
        fields = {
            "fprop_input": fprop.fprop_input,
            "fprop_weight": fprop.fprop_weight,
            "dgrad_weight": dgrad.setting("dgrad_weight"),
            "wgrad_input": wgrad_x,
            "bf16_fprop": False,
        }
    label = name or f"fprop={fprop.name},dgrad={dgrad.name},wgrad={wgrad.name}"
    out = Recipe(**fields, **backward, name=label)
    if not out.quantized:
        return dataclasses.replace(RECIPES["bf16"], name=name or "bf16")
    return out


_NV_X = TensorQuant("nvfp4", (1, 16), "rne")
_NV_W2D = TensorQuant("nvfp4", (16, 16), "rne")
_NV_W1D = TensorQuant("nvfp4", (1, 16), "rne")
_NV_G_SR = TensorQuant("nvfp4", (1, 16), "stochastic")
_NV_G_RNE = TensorQuant("nvfp4", (1, 16), "rne")
_MX_RNE = TensorQuant("mxfp4", (1, 32), "rne")
_MX_SR = TensorQuant("mxfp4", (1, 32), "stochastic")
_MX8 = TensorQuant("mxfp8", (1, 32), "rne")
_46_X = TensorQuant("nvfp4", (1, 16), "rne", block_scale_rule="4over6")
_46_W2D = TensorQuant("nvfp4", (16, 16), "rne", block_scale_rule="4over6")
_46_G_SR = TensorQuant("nvfp4", (1, 16), "stochastic", block_scale_rule="4over6")
_ROW_X = TensorQuant("nvfp4", (1, 16), "rne", outer_scale="row")

RECIPES: MappingProxyType[str, Recipe] = MappingProxyType(
    {
        "nvfp4": Recipe(_NV_X, _NV_W2D, _NV_G_SR, True, name="nvfp4"),
        "nvfp4-no-rht": Recipe(_NV_X, _NV_W2D, _NV_G_SR, False, name="nvfp4-no-rht"),
        "nvfp4-no-sr": Recipe(_NV_X, _NV_W2D, _NV_G_RNE, True, name="nvfp4-no-sr"),
        "nvfp4-no-2d": Recipe(_NV_X, _NV_W1D, _NV_G_SR, True, name="nvfp4-no-2d"),
        "nvfp4-naive": Recipe(_NV_X, _NV_W1D, _NV_G_RNE, False, name="nvfp4-naive"),
        "nvfp4-4over6": Recipe(_46_X, _46_W2D, _46_G_SR, name="nvfp4-4over6"),
        "nvfp4-fwd-mxfp8-bwd": Recipe(
            _NV_X,
            _NV_W2D,
            grad=_MX8,
            dgrad_weight=_MX8,
            wgrad_input=_MX8,
            wgrad_grad=_MX8,
            wgrad_hadamard=False,
            name="nvfp4-fwd-mxfp8-bwd",
        ),
        "nvfp4-per-token": Recipe(_ROW_X, _NV_W2D, _NV_G_SR, name="nvfp4-per-token"),
        "mxfp4": Recipe(_MX_RNE, _MX_RNE, _MX_SR, True, name="mxfp4"),
        "mxfp8": Recipe(_MX8, _MX8, _MX8, False, name="mxfp8"),
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
"""Presets. "nvfp4" is the paper's recipe (TE's `NVFP4BlockScaling` default); the "nvfp4-no-*"
ablations and "nvfp4-naive" drop parts of it. Variants of the full recipe: "nvfp4-4over6" (every
role with Four Over Six block scales, RHT and SR gradients kept), "nvfp4-fwd-mxfp8-bwd" (NVFP4
Fprop; Dgrad and Wgrad in MXFP8 with TE's rounded-up E8M0 scales, no RHT, as TE's MXFP8 recipe),
"nvfp4-per-token" (the activations with one FP32 outer scale per row: per token in Fprop, per
feature of x^T in Wgrad, as TransformerEngine's per-token NVFP4). "mxfp4" uses the OCP scale rule
with the same stochastic rounding and RHT; "mxfp8" is TE's `MXFP8BlockScaling` (E4M3 in 1x32
blocks along each GEMM's contraction, rounded-up E8M0 scales, every role; what Nemotron 3 Super
trains its Mamba out_proj in); "fp8" is per-tensor current scaling (E4M3 forward,
E5M2 gradients); "bf16" quantizes nothing."""


def get_recipe(name: str) -> Recipe:
    """Return the preset called `name` (see `RECIPES`).

    Example:
      >>> get_recipe("nvfp4").fprop_weight.block_shape
      (16, 16)
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {sorted(RECIPES)}")
    return RECIPES[name]


def as_recipe(recipe: Recipe | str) -> Recipe:
    """`recipe` itself, or the preset it names (a `dot_general` / `ragged_dot` argument).

    Raises:
      TypeError: neither a `Recipe` nor a string. ValueError: an unknown preset name.
    """
    if isinstance(recipe, str):
        return get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe or a preset name, got {type(recipe).__name__}")
    return recipe
