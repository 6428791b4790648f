"""Before step 1: a fused attention kernel checked against the reference on this machine.

`cudnn` and `te` run kernels this project cannot run in CI (NVIDIA GPUs only); a kernel that
ignores the document mask, mixes up the rows' documents or the grouped heads, mis-handles a head
size or the run's length, or crashes in its backward would otherwise train a wrong model quietly.
`verify_attention` runs the implementation and a reference ("naive", float32 scores and
softmax; "chunked", equal to it to 1e-6 in the test suite, from `AUTO_CHUNKED_FROM` tokens on,
where naive's [L, L] scores would not fit) on the same inputs, as the run computes: its dtype,
heads, `train.seq_len` and document bound (`max_documents`), every row with its own documents
(`row_documents`: from the bound down to 1, cut at other places in every row, so that a kernel
that reads one row's documents for another fails), under the run's mesh (`constrain`: the
operands laid out as in the model, the kernel partitioned across the run's devices) and remat
policy. It compares the outputs and dq, dk, dv: each within `TOLERANCE` of the reference in
relative L2 norm (what a correct flash kernel in bfloat16 meets with a wide margin: its rounding
is ~2^-8 per element; a mask or row error is O(1)). `nvfp4-train run` runs it for `CHECKED`
implementations under `precision.verify_backend` ("warn": a failing kernel is left out and the
run tries the next fused kernel, then what "auto" picks without fused kernels, saying so;
"strict": the run stops; "off": no check).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_train.model.blocks.attention import (
    AUTO_CHUNKED_FROM,
    attention,
    unfused_attention,
)
from nvfp4_train.model.config import REMAT_POLICIES

CHECKED = ("cudnn", "te")
"""The implementations checked before a run uses them (the others are this project's own code,
or XLA's, verified in the test suite)."""
TOLERANCE = 2e-2
LENGTH = 256
"""The checked length when none is given."""
DOCUMENTS = 3
"""Documents of the fullest checked row when the run has no bound (`max_documents` 0)."""
REFERENCE_BLOCK = 512
"""The tile of the "chunked" reference."""


@dataclasses.dataclass(frozen=True)
class AttentionReport:
    """The outcome of `verify_attention`.

    Attributes:
      implementation: the checked implementation.
      errors: {"out", "dq", "dk", "dv"}: relative L2 error against "naive" (empty if it crashed).
      error: what it raised while checked, or None.
      reference: what it was compared with ("naive" or "chunked").
      layout: what was checked ("4 rows of 8192 tokens, 1 to 12 documents each, remat dots").
    """

    implementation: str
    errors: dict[str, float]
    error: str | None = None
    reference: str = "naive"
    layout: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and all(e <= TOLERANCE for e in self.errors.values())

    def summary(self) -> str:
        if self.error is not None:
            return f"crashed while checked: {self.error}"
        worst = max(self.errors, key=self.errors.get)
        verdict = "agrees with" if self.ok else "DISAGREES with"
        return (
            f"{verdict} {self.reference} attention ({worst} relative error "
            f"{self.errors[worst]:.1e}, tolerance {TOLERANCE:.0e}; {self.layout})"
        )


def row_documents(rows: int, length: int, documents: int, seed: int = 0) -> np.ndarray:
    """int32 [rows, length] segment ids: row r holds max(1, documents - r % documents) documents
    (the fullest exactly `documents`, capped at `length`), cut at random places of its own.

    Example:
        >>> row_documents(2, 8, 3, seed=1).max(axis=1).tolist()
        [2, 1]
    """
    rng = np.random.default_rng(seed)
    documents = max(1, min(documents, length))
    ids = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = rng.choice(
            np.arange(1, length), max(1, documents - r % documents) - 1, replace=False
        )
        ids[r, np.sort(cuts)] = 1
    return np.cumsum(ids, axis=1, dtype=np.int32)


def _inputs(dtype, rows: int, length: int, num_heads: int, num_kv_heads: int, head_dim: int):
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(rows, length, num_heads, head_dim), *[(rows, length, num_kv_heads, head_dim)] * 2]
    q, k, v = (jax.random.normal(key, s, jnp.float32).astype(dtype)
               for key, s in zip(keys, shapes, strict=False))  # fmt: skip
    dout = jax.random.normal(keys[3], shapes[0], jnp.float32).astype(dtype)
    return (q, k, v), dout


def _grads(attend, remat: str, q, k, v, dout, segment_ids) -> tuple[jax.Array, ...]:
    """(out, dq, dk, dv) of `attend(q, k, v, segment_ids)` under the remat policy `remat`."""
    policy = REMAT_POLICIES[remat]
    attend = attend if policy is None else jax.checkpoint(attend, policy=policy)
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), q, k, v)
    return (out, *vjp(dout))


def _errors(checked, reference, remat: str, inputs: tuple, segment_ids) -> dict[str, jax.Array]:
    """{"out", "dq", "dk", "dv"}: float32 relative L2 errors of `checked` against `reference`
    on inputs drawn here (inside the jitted check: no host array is closed over, so the same
    code runs on one device, a mesh, or several processes)."""
    qkv, dout = _inputs(*inputs)
    segment_ids = jnp.asarray(segment_ids)
    got = _grads(checked, remat, *qkv, dout, segment_ids)
    want = _grads(reference, "none", *qkv, dout, segment_ids)

    def relative(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)

    names = ("out", "dq", "dk", "dv")
    return {n: relative(g, w) for n, g, w in zip(names, got, want, strict=True)}


def verify_attention(
    implementation: str, *, dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    seq_len: int = LENGTH, max_documents: int = 0, rows: int = 2, constrain=None,
    remat: str = "none",
) -> AttentionReport:  # fmt: skip
    """`implementation` against the reference here (see the module doc); never raises.

    Args:
      implementation: the checked kernel ("cudnn", "te"; any `model.attention` value works).
      dtype, num_heads, num_kv_heads, head_dim: the run's compute dtype and heads.
      seq_len: the run's `train.seq_len`.
      max_documents: the run's document bound (what "te" is compiled for; 0: one per token):
        the fullest row holds that many documents (`DOCUMENTS` with 0).
      rows: rows of the checked batch (a run passes two per batch shard of its mesh).
      constrain: the run's `constrain(kind, x)` (`mesh.sharding.activation_constraint(mesh)`),
        which lays the operands out over its mesh; None: one device.
      remat: the run's `model.remat` (the check differentiates through that policy).
    """
    documents = max_documents or DOCUMENTS
    segment_ids = row_documents(rows, seq_len, documents)
    name = unfused_attention(seq_len) if seq_len >= AUTO_CHUNKED_FROM else "naive"
    layout = f"{rows} rows of {seq_len} tokens, 1 to {min(documents, seq_len)} documents each"
    layout += f", remat {remat}" if remat != "none" else ""
    checked = functools.partial(attention, implementation=implementation,
                                max_documents=max_documents, constrain=constrain)  # fmt: skip
    reference = functools.partial(attention, implementation=name, block=REFERENCE_BLOCK)
    inputs = (dtype, rows, seq_len, num_heads, num_kv_heads, head_dim)
    try:  # traced anew every time: nothing cached may stand in for the kernel
        errors = jax.jit(lambda: _errors(checked, reference, remat, inputs, segment_ids))()
        errors = {n: float(e) for n, e in errors.items()}  # replicated scalars
    except Exception as e:  # noqa: BLE001 - a kernel may fail in any way; the run must go on
        message = " ".join(f"{type(e).__name__}: {e}".split())
        return AttentionReport(implementation, {}, message[:300], name, layout)
    return AttentionReport(implementation, errors, None, name, layout)
