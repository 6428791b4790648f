"""Before step 1: a fused attention kernel checked against the reference on this machine.

`cudnn` and `te` run kernels this project cannot run in CI (NVIDIA GPUs only); a kernel that
ignores the document mask, mis-handles grouped heads or a head size, or crashes in its backward
would otherwise train a wrong model quietly. `verify_attention` runs the implementation and
"naive" (float32 scores and softmax) on the same inputs in the run's dtype and head layout, with
three documents per row, and compares the outputs and dq, dk, dv: each within `TOLERANCE` of
the reference in relative L2 norm (what a correct flash kernel in bfloat16 meets with a wide
margin: its rounding is ~2^-8 per element; a mask error is O(1)). `nvfp4-train run` runs it for
`CHECKED` implementations under `precision.verify_backend` ("warn": a failing kernel is left out
and the run uses what "auto" picks without it, saying so; "strict": the run stops; "off": no
check).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_train.model.attention import attention, naive_attention

CHECKED = ("cudnn", "te")
"""The implementations checked before a run uses them (the others are this project's own code,
or XLA's, verified in the test suite)."""
TOLERANCE = 2e-2
LENGTH = 256
DOCUMENTS = (100, 36, 120)
"""Document lengths of each checked row (tokens; they sum to `LENGTH`)."""


@dataclasses.dataclass(frozen=True)
class AttentionReport:
    """The outcome of `verify_attention`.

    Attributes:
      implementation: the checked implementation.
      errors: {"out", "dq", "dk", "dv"}: relative L2 error against "naive" (empty if it crashed).
      error: what it raised while checked, or None.
    """

    implementation: str
    errors: dict[str, float]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(e <= TOLERANCE for e in self.errors.values())

    def summary(self) -> str:
        if self.error is not None:
            return f"crashed while checked: {self.error}"
        worst = max(self.errors, key=self.errors.get)
        verdict = "agrees with" if self.ok else "DISAGREES with"
        return (
            f"{verdict} naive attention ({worst} relative error {self.errors[worst]:.1e}, "
            f"tolerance {TOLERANCE:.0e}; {LENGTH} tokens, {len(DOCUMENTS)} documents per row)"
        )


def _inputs(dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(2, LENGTH, num_heads, head_dim), *[(2, LENGTH, num_kv_heads, head_dim)] * 2]
    q, k, v = (jax.random.normal(key, s, jnp.float32).astype(dtype)
               for key, s in zip(keys, shapes, strict=False))  # fmt: skip
    dout = jax.random.normal(keys[3], shapes[0], jnp.float32).astype(dtype)
    ids = np.repeat(np.arange(len(DOCUMENTS), dtype=np.int32), DOCUMENTS)
    return (q, k, v), dout, jnp.asarray(np.stack([ids, ids]))


def _relative(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def verify_attention(
    implementation: str, *, dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    max_documents: int = 0,
) -> AttentionReport:  # fmt: skip
    """`implementation` against "naive" here (see the module doc); never raises."""
    qkv, dout, segment_ids = _inputs(dtype, num_heads, num_kv_heads, head_dim)

    def grads(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids), *qkv)
        return (out, *vjp(dout))

    # a bound below the check's own documents would fail it for the wrong reason (a run with
    # such rows stops at its first batch instead: the loop's host check)
    bound = max(max_documents, len(DOCUMENTS)) if max_documents else 0
    checked = functools.partial(attention, implementation=implementation, max_documents=bound)
    try:
        got = jax.device_get(jax.jit(lambda: grads(checked))())
    except Exception as e:  # noqa: BLE001 - a kernel may fail in any way; the run must go on
        message = " ".join(f"{type(e).__name__}: {e}".split())
        return AttentionReport(implementation, {}, message[:300])
    reference = jax.device_get(jax.jit(lambda: grads(naive_attention))())
    names = ("out", "dq", "dk", "dv")
    errors = {n: _relative(g, r) for n, g, r in zip(names, got, reference, strict=True)}
    return AttentionReport(implementation, errors)
