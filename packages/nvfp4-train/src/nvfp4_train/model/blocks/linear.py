"""The quantized linear of every block: `QuantLinear` (its matmul is `nvfp4_ops.dot_general` with
a fixed recipe) and what it sows (input amax, and in telemetry's capture mode its operands).

Parameters are float32 master weights; a block casts them to its compute dtype. Only the linears
go through `nvfp4_ops.dot_general` with their own `Recipe`; norms, RoPE, attention BMMs, softmax,
the Mamba conv and scan stay in BF16/FP32 and are never quantized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.weight_gather import (
    check_tiles,
    gather_compute,
    gather_plan,
    gather_quantized,
    linear_product,
    mode_for,
    product_with_gathered,
)

INPUT_AMAX = "input_amax"
"""Name of the `nnx.Intermediate` each `QuantLinear` call sows: max |input| of that call."""
OPERAND_X, OPERAND_W = "x", "w"
"""Names of the `LinearOperand`s a `QuantLinear` in capture mode sows: its GEMM input and kernel."""
OUTPUT_GRAD = "output"
"""Name of the zero `nnx.Perturbation` a `QuantLinear` in capture mode adds to its output."""


class LinearOperand(nnx.Variable):
    """A GEMM operand (input or kernel, compute dtype) sown by a `QuantLinear` in capture mode."""


def _zero_f32() -> jax.Array:
    return jnp.zeros((), jnp.float32)


def sow_input_amax(module: nnx.Module, amax: jax.Array) -> None:
    """Sows `amax` on `module` as the `nnx.Intermediate` `INPUT_AMAX`, max-reduced with what is
    already sown (a float32 scalar, or one per layer for a stacked block)."""
    module.sow(nnx.Intermediate, INPUT_AMAX, amax, reduce_fn=jnp.maximum, init_fn=_zero_f32)


def _latest(previous, value):
    del previous
    return value


class QuantLinear(nnx.Module):
    """A linear `y = x @ W (+ b)` whose matmul is `nvfp4_ops.dot_general` with a fixed recipe.

    The kernel is stored [in, out] in float32 (like `nnx.Linear`); the optional bias (float32,
    init 0) is added to the float32 GEMM output and is never quantized. The recipe and the
    `nvfp4_ops` backend ("auto", a name, or an order of names) are static attributes, so they
    are part of the graphdef and not of the parameters.

    Capture mode (`capture_operands = True`, set only on a merged copy inside a telemetry probe,
    see `nvfp4_train.observe.telemetry`) additionally sows the GEMM input and the kernel as
    `LinearOperand`s named `OPERAND_X` / `OPERAND_W` and adds the `nnx.Perturbation` named
    `OUTPUT_GRAD` to the output, so the gradient w.r.t. it is dy. Off (the default) the call traces
    to exactly the same graph as without it.

    `gather` ("master", "compute" or "quantized", `precision.gather`) and `kernel_axes` (the mesh
    axes of the kernel, `mesh.sharding.kernel_axes`) are static attributes set on a built model
    (`training.step.ModelSpec.build`): under a context mesh whose `fsdp` splits the kernel, it is
    gathered as `nvfp4_train.model.weight_gather` says (same bits in every mode).

    Example:
        >>> lin = QuantLinear(64, 32, recipe=nvfp4_ops.get_recipe("bf16"), init_std=0.02,
        ...                   dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        >>> lin(jnp.ones((2, 64), jnp.bfloat16)).shape
        (2, 32)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: nvfp4_ops.Recipe,
        init_std: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        backend: str | tuple[str, ...] = "auto",
        use_bias: bool = False,
    ):
        init = jax.nn.initializers.normal(stddev=init_std)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None
        self.recipe = recipe
        self.backend = backend
        self.dtype = dtype
        self.capture_operands = False
        self.gather = "master"
        self.kernel_axes = None

    def __call__(self, x_NxI: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Returns `x @ kernel` in the compute dtype; `key` feeds the recipe's stochastic rounding.

        Sows `max |x|` (float32 scalar, x after the cast to the compute dtype and before
        quantization) as the `nnx.Intermediate` named `INPUT_AMAX`; `pop_input_amax` collects it.
        """
        x = x_NxI.astype(self.dtype)
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
        sow_input_amax(self, amax)
        w = self.kernel[...].astype(self.dtype)
        y = self._product(x, w, key)
        if self.bias is not None:
            y = y + self.bias[...]
        y = y.astype(self.dtype)
        if self.capture_operands:
            self.sow(LinearOperand, OPERAND_X, x, reduce_fn=_latest)
            self.sow(LinearOperand, OPERAND_W, w, reduce_fn=_latest)
            y = self.perturb(OUTPUT_GRAD, y)
        return y

    def _product(self, x: jax.Array, w: jax.Array, key: jax.Array | None) -> jax.Array:
        """x @ w in float32 through the recipe, w gathered per `self.gather`."""
        mode = mode_for(self.gather, self.recipe)
        plan = None if mode == "master" else gather_plan(self.kernel_axes, w.shape)
        if plan is not None and mode == "quantized":
            check_tiles(plan, w.shape, "a QuantLinear's kernel")
            qw = gather_quantized(w, plan, self.recipe)
            return nvfp4_ops.prequantized_dot_general(
                x, w, qw, preferred_element_type=jnp.float32, recipe=self.recipe, key=key,
                backend=self.backend,
            )  # fmt: skip
        if plan is not None:
            gathered = gather_compute(w, plan)
            return product_with_gathered(x, w, gathered, key, self.recipe, self.backend)
        return linear_product(x, w, key, self.recipe, self.backend)
