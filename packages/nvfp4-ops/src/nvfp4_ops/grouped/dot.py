"""`ragged_dot`: the NVFP4 training recipe for grouped experts, a drop-in in the spirit of
`jax.lax.ragged_dot`.

Each group is exactly the dense call `dot_general(x_g, w[e], recipe=recipe,
key=jax.random.fold_in(key, e))` on its rows x_g, bit for bit, forward and both gradients:
- Fprop x_g . W_e, Dgrad dY_g . W_e^T with the Fprop's 16x16-quantized W_e reused, Wgrad
  x_g^T . dY_g over the group's own tokens, with the RHT and stochastic rounding where the
  recipe has them (`nvfp4_ops.gemm_table`);
- per-group outer (tensor) scales: each expert's weight, and each group's activations and
  gradients, from that group's amax (as TE's PyTorch grouped NVFP4, and the serving
  layouts' one `weight_scale_2` / `input_scale` per expert, expect);
- padding: the Wgrad operands are blocked along the tokens (1x16 blocks and the 16-point
  RHT; 1x32 for MXFP4), so no block may take rows of two groups: every group is padded with
  zero rows to a multiple of `recipe.alignment`, which is exactly the zero padding its dense
  call adds (zeros change no amax and no sum; the RHT spreads them inside the group's last
  tile only). The groups sit in one static buffer of floor((T + E (a - 1)) / a) tiles of
  a rows: at most E (a - 1) rows more than x, whatever the traced group sizes.
- stochastic rounding: group e's keys are `split_keys(fold_in(key, group_offset + e))`, as
  its dense call splits them (`group_offset` 0: `fold_in(key, e)`); the random bytes of x,
  dY and their transposes are rebuilt from threefry counters at each element's index in its
  group's dense operand (so `key` must be a threefry2x32 key when a token operand rounds
  stochastically), O(T) work.

Bit-exactness assumes XLA's FP32 dot computes each output row independently of the others
and ignores zeros appended to its contraction (true of XLA:CPU, tested; see
`nvfp4_ops.grouped.gemm`). Every GEMM is a batched `dot_general` over static blocks or windows:
no data-dependent shape or trip count, no `jax.lax.ragged_dot`.

Backends (`backend=`): "emulated" (exact, any device: FP32 dots, Fprop/Dgrad over blocks of each
group's rows, Wgrad in one window per group; < 1.25x one dense call's GEMM work for the rows, up to
~1.19 H_E x for Wgrad), "xla" (the same quantized operands as BF16 values, exact, with FP32
outer scales applied to the output: batched BF16 GEMMs with FP32 accumulation, which XLA runs on
tensor cores on GPUs; Wgrad as per-block partial products summed per group; equal to "emulated"
up to FP32 summation order and the rounding of the outer scales), "te" (refused:
TransformerEngine's grouped GEMM takes no NVFP4 operands, `te_backend.TE_GROUPED_UNSUPPORTED`),
"auto" (as for `dot_general`: the first of `auto_order()` that can run the call, a native backend
only once verified), or a tuple tried in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.backends import Call, operand_devices, select_backend
from nvfp4_ops.gemm_table import as_key, operand_quants
from nvfp4_ops.grouped.layout import GroupShape
from nvfp4_ops.grouped.qdot import GroupedConfig, grouped_quantized_dot
from nvfp4_ops.grouped.random_bits import check_threefry
from nvfp4_ops.grouped.unquantized import PlainConfig, grouped_plain_dot
from nvfp4_ops.recipe import Recipe, as_recipe


def ragged_dot(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: Recipe | str,
    key: jax.Array | None = None,
    backend: str | tuple[str, ...] = "auto",
    preferred_element_type=None,
    group_offset: int | jax.Array = 0,
) -> jax.Array:
    """y[t] = x[t] . w[e] for the rows t of group e, through the recipe's three quantized GEMMs.

    The grouped (Mixture-of-Experts) counterpart of `nvfp4_ops.dot_general`, shaped like
    `jax.lax.ragged_dot`: x [T, K] holds the groups' rows back to back (group e: the next
    group_sizes[e] rows), w [E, K, N] one weight per group, y [T, N]; gradients come back in the
    dtypes of x and w. Rows past sum(group_sizes) are padding: zero output rows, zero gradients.
    Each group is bit for bit its dense call (per-group scales, padding, keys: the module
    docstring).

    Args:
      x: [T, K] activations, rows sorted by group. K a multiple of `recipe.alignment`.
      w: [E, K, N] weights. N a multiple of `recipe.alignment`.
      group_sizes: int32 [E], rows per group (a traced value is fine); sum at most T (larger
        sums are cut at T).
      recipe: a `Recipe` or a preset name. One that quantizes nothing ("bf16") runs
        `lax.dot_general` per group with JAX's own gradient GEMMs (`grouped.unquantized`).
      key: PRNG key for stochastic rounding; required when the recipe uses it.
      backend: "emulated", "xla", "te" (refused), "auto" or a tuple tried in order (the module
        docstring, "Backends").
      preferred_element_type: output dtype; default the promoted dtype of x and w.
      group_offset: the global index of group 0 when w holds a slice of the experts (an int >= 0
        or a traced int32 scalar): group e rounds with the keys of group `group_offset + e`, so
        a shard of the experts equals those groups of the whole call, bit for bit.

    Raises:
      TypeError: non-floating x or w, group_sizes not int32, or group_offset not an integer.
      ValueError: shapes that do not fit (naming the argument, the expected and the actual),
        or a backend that cannot run the call.

    Example:
      >>> x, w = jnp.ones((40, 32)), jnp.ones((3, 32, 16))
      >>> y = ragged_dot(x, w, jnp.array([20, 0, 16], jnp.int32), recipe="nvfp4-no-sr")
      >>> y.shape, float(y[39, 0])  # rows past sum(group_sizes) = 36 are zero
      ((40, 16), 0.0)
    """
    recipe = as_recipe(recipe)
    group_sizes, group_offset = _checked_groups(x, w, group_sizes, group_offset, recipe)
    key = as_key(key, recipe)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(x, w))
    if x.shape[0] == 0:  # nothing to quantize: the (empty) product, zero gradients
        return jnp.matmul(x, w[0], preferred_element_type=out_dtype)
    compute_dtype = np.dtype(jnp.result_type(x.dtype, w.dtype))
    call = Call(recipe, 1, compute_dtype, out_dtype, operand_devices(x, w), grouped=True)
    name = select_backend(backend, call)
    if not recipe.quantized:
        return _unquantized(x, w, group_sizes, name, preferred_element_type)
    if key is not None and _stochastic_tokens(recipe):
        check_threefry(key)
    return _grouped(x, w, group_sizes, key, group_offset, recipe, name, out_dtype)


def _checked_groups(x, w, group_sizes, group_offset, recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    """(group_sizes, group_offset) as int32 arrays, after the checks of the operands' shapes and
    dtypes (`_check_operands`) and of the offset (`_offset`)."""
    if not hasattr(group_sizes, "dtype"):  # a list of Python ints
        group_sizes = jnp.asarray(group_sizes, jnp.int32)
    _check_operands(x, w, group_sizes, recipe)
    return group_sizes, _offset(group_offset)


def _stochastic_tokens(recipe: Recipe) -> bool:
    """Whether an x or dY operand (not a weight) rounds stochastically."""
    return any(
        op.spec.tensor != "w" and op.tq.rounding == "stochastic"
        for op in operand_quants(recipe).values()
    )


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _grouped(x, w, group_sizes, key, group_offset, recipe, backend, out_dtype) -> jax.Array:
    """The quantized grouped custom_vjp (one jit per shape and recipe)."""
    shape = GroupShape(x.shape[0], w.shape[0], recipe.alignment)
    cfg = GroupedConfig(
        recipe, backend, out_dtype, np.dtype(x.dtype), np.dtype(w.dtype), shape
    )  # fmt: skip
    with jax.named_scope(f"nvfp4/ragged_dot[{recipe.name}]"):
        return grouped_quantized_dot(x, w, group_sizes, key, group_offset, cfg)


def _unquantized(x, w, group_sizes, backend, preferred) -> jax.Array:
    """A recipe quantizing nothing: `lax.dot_general` per group (`grouped.unquantized`)."""
    dims = (((1,), (0,)), ((), ()))
    out = jax.eval_shape(
        lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=preferred),
        x,
        jax.ShapeDtypeStruct(w.shape[1:], w.dtype),
    )
    shape = GroupShape(x.shape[0], w.shape[0], 1)
    preferred = None if preferred is None else np.dtype(preferred)
    dtypes = (np.dtype(x.dtype), np.dtype(w.dtype), np.dtype(out.dtype))
    cfg = PlainConfig(preferred, *dtypes, shape, blocked=backend == "xla")
    return _plain(x, w, group_sizes, cfg)


@functools.partial(jax.jit, static_argnums=(3,))
def _plain(x, w, group_sizes, cfg: PlainConfig) -> jax.Array:
    with jax.named_scope("nvfp4/ragged_dot[unquantized]"):
        return grouped_plain_dot(x, w, group_sizes, cfg)


def _offset(group_offset) -> jax.Array:
    """`group_offset` as an int32 scalar; ValueError / TypeError naming it otherwise."""
    if isinstance(group_offset, int | np.integer) and not isinstance(group_offset, bool):
        if group_offset < 0:
            raise ValueError(f"group_offset must be >= 0, got {group_offset}")
        return jnp.asarray(group_offset, jnp.int32)
    dtype, shape = getattr(group_offset, "dtype", None), getattr(group_offset, "shape", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or shape != ():
        raise TypeError(
            f"group_offset must be an int or an integer scalar array, got {group_offset!r}"
        )
    return jnp.asarray(group_offset).astype(jnp.int32)


def _check_operands(x, w, group_sizes, recipe: Recipe) -> None:
    """TypeError / ValueError naming the argument, the expected and the actual value."""
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got dtype {a.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, K] (rows sorted by group), got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"w must be 3-D [E, K, N] (one weight per group), got shape {w.shape}")
    if w.shape[0] < 1:
        raise ValueError(f"w must hold at least one group, got shape {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"x and w must share K: x.shape[1] = {x.shape[1]}, w.shape[1] = {w.shape[1]} "
            f"(x {x.shape}, w {w.shape})"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"group_sizes must have shape (E,) = ({w.shape[0]},), one size per weight of w "
            f"{w.shape}, got shape {group_sizes.shape}"
        )
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32 (as lax.ragged_dot's), got {group_sizes.dtype}")
    a = recipe.alignment
    for axis, size in (("K", x.shape[1]), ("N", w.shape[2])):
        if size % a:
            raise ValueError(
                f"{axis} must be a multiple of {a} (recipe {recipe.name!r}'s alignment: blocks "
                f"and tiles along {axis}; ragged_dot pads only the tokens), got {axis}={size}"
            )
