"""Normalise any `lax.dot_general` layout to [B, M, K] x [B, K, N] and back.

B is the product of the batch dimensions, M of lhs's free dimensions, K of the contracting
dimensions (flattened in the order given), N of rhs's free dimensions. The output of
`lax.dot_general` is (batch..., lhs free..., rhs free...), which is exactly [B, M, N] reshaped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of one dot_general's operand layout (hashable)."""

    lhs_perm: tuple[int, ...]
    rhs_perm: tuple[int, ...]
    batch_shape: tuple[int, ...]
    lhs_free_shape: tuple[int, ...]
    rhs_free_shape: tuple[int, ...]
    contract_size: int

    @property
    def bmkn(self) -> tuple[int, int, int, int]:
        """(B, M, K, N) of the canonical form."""
        return (
            math.prod(self.batch_shape),
            math.prod(self.lhs_free_shape),
            self.contract_size,
            math.prod(self.rhs_free_shape),
        )

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.batch_shape + self.lhs_free_shape + self.rhs_free_shape


def _axes(name: str, dims: Sequence[int], ndim: int) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise ValueError(f"{name} has axis {d!r} out of range for an operand of rank {ndim}")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} repeats an axis: {tuple(dims)}")
    return tuple(out)


def make_layout(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers
) -> Layout:
    """Validate `dimension_numbers` like `lax.dot_general` and build the canonical `Layout`."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError) as err:
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
            f"got {dimension_numbers!r}"
        ) from err
    lc, lb = _axes("lhs contracting", lc, len(lhs_shape)), _axes("lhs batch", lb, len(lhs_shape))
    rc, rb = _axes("rhs contracting", rc, len(rhs_shape)), _axes("rhs batch", rb, len(rhs_shape))
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"lhs and rhs need as many contracting and batch axes, got {dimension_numbers!r}"
        )
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(f"an axis is both batch and contracting in {dimension_numbers!r}")
    for side, (a, b) in (("contracting", (lc, rc)), ("batch", (lb, rb))):
        ls, rs = [lhs_shape[i] for i in a], [rhs_shape[i] for i in b]
        if ls != rs:
            raise ValueError(f"{side} dimension sizes differ: lhs {ls} vs rhs {rs}")
    lfree = tuple(i for i in range(len(lhs_shape)) if i not in lc and i not in lb)
    rfree = tuple(i for i in range(len(rhs_shape)) if i not in rc and i not in rb)
    return Layout(
        lhs_perm=lb + lfree + lc,
        rhs_perm=rb + rc + rfree,
        batch_shape=tuple(lhs_shape[i] for i in lb),
        lhs_free_shape=tuple(lhs_shape[i] for i in lfree),
        rhs_free_shape=tuple(rhs_shape[i] for i in rfree),
        contract_size=math.prod(lhs_shape[i] for i in lc),
    )


def to_canonical(lhs: jax.Array, rhs: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """lhs -> [B, M, K], rhs -> [B, K, N]."""
    b, m, k, n = layout.bmkn
    lhs_c = jnp.transpose(lhs, layout.lhs_perm).reshape(b, m, k)
    rhs_c = jnp.transpose(rhs, layout.rhs_perm).reshape(b, k, n)
    return lhs_c, rhs_c


def from_canonical(out_bmn: jax.Array, layout: Layout) -> jax.Array:
    """[B, M, N] -> the `lax.dot_general` output shape (batch..., lhs free..., rhs free...)."""
    return out_bmn.reshape(layout.out_shape)


def pad_to(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pad each axis of `x` up to a multiple of the matching entry (no-op when aligned)."""
    pads = [(0, -s % m) for s, m in zip(x.shape, multiples, strict=True)]
    if not any(hi for _, hi in pads):
        return x
    return jnp.pad(x, pads)
