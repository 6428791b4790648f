"""TransformerEngine backend: the recipe's three GEMMs through TE's JAX NVFP4 quantizers and GEMM.

UNTESTED ON BLACKWELL HARDWARE. What is verified, and where (docs/ops.md, "Backends"):
- every TransformerEngine name, keyword argument, dataclass field and enum member this module
  uses is checked against the JAX sources of the pinned TE releases (`nox -s te_conformance`;
  parsed, not imported, since TE's JAX package needs CUDA to import);
- the same session runs `te_dot` end to end on CPU through TE's own pure-JAX quantize and GEMM
  fallbacks (a documented stand-in replaces TE's compiled extension there) and compares it with
  the emulated backend;
- on the user's machine `nvfp4_ops.verify_backend("te")` (run by `nvfp4-ops doctor --verify` and
  before the first step of `nvfp4-train run`) checks it against the emulated backend before it is
  trusted.

The linear runs as TE's own `dense` does (transformer_engine/jax/dense.py: quantize x and the
kernel with the recipe's quantizers, GEMM NN; in the backward quantize dY, GEMM NT for dX and TN for
dW), written out here as a `jax.custom_vjp` so that the operands can be padded to TE's alignment
and each GEMM writes the dtype that `dot_general` promises (TE's dense writes its input dtype).
Each quantize passes the amax scope `dense` passes (`AMAX_SCOPES`: x and dY over the tensor-
sequence axis, the kernel over the FSDP axis), so that a sharded weight is encoded with the amax
of the whole weight; under a mesh, TE reads the axes from its `MeshResource`, which
`te_sharding(mesh, ...)` sets for the duration of a jitted call (its compile included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import re
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.canonical import Layout, from_canonical, pad_to, to_canonical
from nvfp4_ops.gemm_table import split_keys
from nvfp4_ops.qdot import named_residuals
from nvfp4_ops.recipe import Recipe
from nvfp4_ops.te_requirements import (
    BLOCK,
    RECIPE_ENVIRONMENT,
    TE_GROUPED_UNSUPPORTED,
    TE_MIN_VERSION,
    TE_OUTPUT_DTYPES,
    TE_TESTED_VERSIONS,
    environment_conflicts,
    te_alignment,
    te_unsupported,
)

__all__ = [  # the requirements are re-exported from `te_requirements`, where they live
    "AMAX_SCOPES",
    "BLOCK",
    "NEUTRAL_RECIPE_FIELDS",
    "RECIPE_ENVIRONMENT",
    "TE_GROUPED_UNSUPPORTED",
    "TE_MIN_VERSION",
    "TE_OUTPUT_DTYPES",
    "TE_TESTED_VERSIONS",
    "environment_conflicts",
    "te_alignment",
    "te_dot",
    "te_host_support",
    "te_recipe",
    "te_sharding",
    "te_unsupported",
    "te_version_problem",
]

NEUTRAL_RECIPE_FIELDS = {
    "row_scaled_activation": False,
    "nvfp4_4over6": "none",
    "backward_override": None,
    "fp8_dpa": False,
    "fp8_mha": False,
}
"""`NVFP4BlockScaling` fields (of the releases that have them) set explicitly to the paper's
recipe, so that no environment default can change them."""

AMAX_SCOPES = {"x": "TPSP", "kernel": "FSDP", "grad": "TPSP"}
"""The `AmaxScope` member each operand's quantize passes, as TE's `dense` passes them (2.14 to
2.20.2: transformer_engine/jax/dense.py); the conformance session checks it against `dense`."""


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "2.20.2+cu12"."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def te_version_problem() -> str | None:
    """Why the installed TransformerEngine is too old for this nvfp4-ops (None: it is not)."""
    version = str(importlib.import_module("transformer_engine").__version__)
    if _release(version) >= TE_MIN_VERSION:
        return None
    floor = ".".join(map(str, TE_MIN_VERSION))
    return (
        f"TransformerEngine {version} is older than {floor}, the oldest release this "
        "nvfp4-ops is verified against (pip install 'nvfp4-ops[te]')"
    )


def te_host_support(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether the installed TransformerEngine can run NVFP4 here as this module drives it.

    Requires TE >= `TE_MIN_VERSION`, no `RECIPE_ENVIRONMENT` variable in `environ`, and TE's own
    NVFP4 support check (compute capability >= 10.0, CUDA and cuBLASLt >= 12.8) to pass for 1x16
    and 16x16 scaling.
    """
    too_old = te_version_problem()
    if too_old is not None:
        return False, too_old
    version = str(importlib.import_module("transformer_engine").__version__)
    conflicts = environment_conflicts(environ)
    if conflicts:
        return False, (
            f"{', '.join(conflicts)} would change TE's recipe or kernels behind the configured "
            "recipe; unset it (the recipe is set through nvfp4_ops.Recipe)"
        )
    te_quantize = _te_quantize()
    modes = te_quantize.ScalingMode
    for mode in (modes.NVFP4_1D_SCALING, modes.NVFP4_2D_SCALING):
        ok, why = te_quantize.is_scaling_mode_supported(mode)
        if not ok:
            return False, f"TransformerEngine {version} cannot run NVFP4 here: {why}"
    return True, f"TransformerEngine {version} runs NVFP4 here"


def te_recipe(recipe: Recipe):
    """TE's `NVFP4BlockScaling` for `recipe`, every known field explicit (no environment default).

    Raises:
      ValueError: TE cannot express the recipe (see `te_unsupported`).
    """
    reason = te_unsupported(recipe)
    if reason is not None:
        raise ValueError(f"backend='te' cannot run recipe {recipe.name!r}: {reason}")
    cls = importlib.import_module("transformer_engine.common.recipe").NVFP4BlockScaling
    known = {f.name for f in dataclasses.fields(cls)}
    neutral = {k: v for k, v in NEUTRAL_RECIPE_FIELDS.items() if k in known}
    return cls(
        disable_rht=not recipe.wgrad_hadamard,
        disable_stochastic_rounding=recipe.grad.rounding != "stochastic",
        disable_2d_quantization=not recipe.fprop_weight.is_2d,
        **neutral,
    )


@dataclasses.dataclass(frozen=True)
class _TeCall:
    """Static settings of one TE linear (hashable, a `nondiff_argnums` value)."""

    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype


def _tex():
    """transformer_engine.jax.cpp_extensions (TE's quantize and GEMM), imported on first use."""
    return importlib.import_module("transformer_engine.jax.cpp_extensions")


def _te_quantize():
    """transformer_engine.jax.quantize (quantizers, their metadata, tensor usages)."""
    return importlib.import_module("transformer_engine.jax.quantize")


def _te_sharding():
    """transformer_engine.jax.sharding (MeshResource, global_shard_guard, the mesh's size)."""
    return importlib.import_module("transformer_engine.jax.sharding")


def _amax_scope(operand: str):
    """TE's `AmaxScope` member for `operand` ("x", "kernel" or "grad"), see `AMAX_SCOPES`."""
    scopes = importlib.import_module("transformer_engine.jax.cpp_extensions.amax").AmaxScope
    return {"TPSP": scopes.TPSP, "FSDP": scopes.FSDP}[AMAX_SCOPES[operand]]


@contextlib.contextmanager
def te_sharding(
    mesh: jax.sharding.Mesh, *, data: str | None = None, fsdp: str | None = None
) -> Iterator[None]:
    """TE's view of `mesh` while a jitted call is traced AND compiled inside this block.

    TE's custom-partitioned quantize and GEMM read the data-parallel and FSDP axes from a
    global `MeshResource` (`global_shard_guard`) when XLA partitions them, at compile time: the
    FSDP amax scope of a weight reduces over `fsdp`, and the GEMM gathers a weight along it. TE
    also reads the mesh itself (`jax.set_mesh`) for the size of the stochastic-rounding state.
    Without them a sharded TE call fails to compile. A tensor-parallel axis needs no entry: TE's
    GEMM reduces over whatever axis shards both contractions, and naming it (`tp_resource`)
    would make TE look the mesh up again on XLA's partitioner thread, where the mesh context of
    this thread is not set (jax 0.10.2: "tensor is not a axis of the given mesh"; found by the
    conformance session).

    Args:
      mesh: the mesh the call's operands are sharded over.
      data, fsdp: the names of its data-parallel and FSDP axes (None for one it does not have).

    Raises:
      ValueError: an axis name that is not one of the mesh's axes.

    Example:
      >>> with te_sharding(mesh, data="data", fsdp="fsdp"):  # doctest: +SKIP
      ...     grads = train_step(state, batch)
    """
    named = {"data": data, "fsdp": fsdp}
    unknown = {k: v for k, v in named.items() if v is not None and v not in mesh.axis_names}
    if unknown:
        raise ValueError(f"te_sharding: {unknown} are not axes of the mesh {mesh.axis_names}")
    sharding = _te_sharding()
    resource = sharding.MeshResource(dp_resource=data, fsdp_resource=fsdp)
    with jax.set_mesh(mesh), sharding.global_shard_guard(resource):
        yield


def _quantizer_set(recipe: Recipe, key: jax.Array | None):
    """TE's quantizers for the recipe, with `QuantizeMeta` set as TE's own Flax layers set it.

    RHT on the column-wise (Wgrad) usage of x and dY only; the stochastic-rounding state of the
    gradient quantizer is uint32 [devices in the mesh, 4] drawn from the call's "dgrad_dy" key.
    """
    te_quantize = _te_quantize()
    rht = recipe.wgrad_hadamard
    if recipe.grad.rounding == "stochastic":
        devices = int(_te_sharding().get_num_devices_in_mesh())
        state = jax.random.bits(split_keys(key)["dgrad_dy"], (devices, 4), jnp.uint32)
        grad = te_quantize.QuantizeMeta(use_rht=rht, stochastic_rounding_rng_state=state)
    else:
        grad = te_quantize.QuantizeMeta(use_rht=rht)
    metas = te_quantize.QuantizeMetaSet(
        x=te_quantize.QuantizeMeta(use_rht=rht),
        kernel=te_quantize.QuantizeMeta(use_rht=False),
        grad=grad,
    )
    return te_quantize.QuantizerFactory.create_set(
        fp8_recipe=te_recipe(recipe), quantize_meta_set=metas
    )


def _writing(tensor, dtype: np.dtype):
    """The quantized GEMM operand whose GEMM writes `dtype` (TE's GEMM writes lhs.dq_dtype)."""
    return dataclasses.replace(tensor, dq_dtype=jnp.dtype(dtype))


def _te_fwd(x_mk, w_kn, key, call: _TeCall):
    tex, usage = _tex(), _te_quantize().TensorUsage
    quantizers = _quantizer_set(call.recipe, key)
    casted_x = tex.quantize(
        x_mk, flatten_axis=-1, quantizer=quantizers.x, amax_scope=_amax_scope("x")
    )
    casted_w = tex.quantize(
        w_kn, flatten_axis=-1, quantizer=quantizers.kernel, amax_scope=_amax_scope("kernel")
    )
    y = tex.gemm(
        _writing(casted_x.get_tensor(usage=usage.LHS), call.out_dtype),
        casted_w.get_tensor(usage=usage.RHS),
        contracting_dims=((1,), (0,)),
    )
    saved = (casted_x.get_tensor(usage=usage.LHS_TRANS), casted_w.get_tensor(usage=usage.RHS_TRANS))
    return y, (*named_residuals(saved), key)


def _te_bwd(call: _TeCall, residuals, dy_mn):
    tex, usage = _tex(), _te_quantize().TensorUsage
    x_t, w_t, key = residuals
    quantizers = _quantizer_set(call.recipe, key)
    casted_dy = tex.quantize(
        dy_mn.astype(jnp.bfloat16),
        flatten_axis=-1,
        quantizer=quantizers.dgrad,
        amax_scope=_amax_scope("grad"),
    )
    dx = tex.gemm(
        _writing(casted_dy.get_tensor(usage=usage.LHS), call.lhs_dtype),
        w_t,
        contracting_dims=((1,), (1,)),
    )
    dw = tex.gemm(
        _writing(x_t, call.rhs_dtype),
        casted_dy.get_tensor(usage=usage.RHS),
        contracting_dims=((0,), (0,)),
    )
    return dx, dw, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _te_linear(x_mk, w_kn, key, call: _TeCall):
    """y[M, N] = x[M, K] . w[K, N] through TE's quantizers and GEMM (aligned BF16 operands)."""
    return _te_fwd(x_mk, w_kn, key, call)[0]


_te_linear.defvjp(_te_fwd, _te_bwd)


def te_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    layout: Layout,
    recipe: Recipe,
    key: jax.Array | None,
    out_dtype: np.dtype,
) -> jax.Array:
    """y = lhs . rhs through TransformerEngine, zero-padded to TE's alignment and sliced back.

    Zero padding changes no amax and no sum, so the result is the unpadded one. The output has
    `out_dtype`; the gradients the dtypes of `lhs` and `rhs`.

    Raises:
      ValueError: the recipe, the batch dimensions or the dtypes are not what TE runs
        (`te_unsupported`).
    """
    b, m, _, n = layout.bmkn
    dtype = np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    reason = te_unsupported(recipe, b, dtype, out_dtype)
    if reason is not None:
        raise ValueError(f"backend='te' cannot run this dot_general: {reason}")
    call = _TeCall(recipe, np.dtype(out_dtype), np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    am, ak, an = te_alignment(recipe)
    x, w = to_canonical(lhs, rhs, layout)
    x_mk = pad_to(x[0], (am, ak))
    w_kn = pad_to(w[0], (ak, an))
    with jax.named_scope(f"nvfp4/te_linear[{recipe.name}]"):
        y = _te_linear(x_mk, w_kn, key, call)
    return from_canonical(y[None, :m, :n], layout)
