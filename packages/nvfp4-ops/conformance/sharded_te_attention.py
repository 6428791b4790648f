"""TE's fused attention (`nvfp4_ops.te_attention`) partitioned over fake CPU devices.

Run as a script in its own process (the device count is fixed when jax initialises):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python sharded_te_attention.py ROOT VERSION
the release unpacked at ROOT, its JAX layers over te_standin.py's extension and
te_attention_standin.py's CPU kernel, on a (data=2, fsdp=1, tensor=2) mesh; 4 rows of 16 tokens,
each with its own documents (up to 4), 4 query heads sharing 2 kv heads. What it shows, and what
nvfp4-train does about each:

1. Traced and compiled outside `te_sharding` (TE's mesh and `MeshResource`), TE takes the
   context-parallel axis to be "" and its partition fails ('"" is not a axis of the given
   mesh'): nvfp4-train enters `te_sharding` whenever its attention is te on a mesh
   (`backend_check.te_context(..., attention=...)`), not only for TE's GEMMs.
2. Inside `te_sharding`, with q, k, v split over heads (`tensor`) and rows (`data`), the
   segment ids like q's rows, and the output like q (`nvfp4_train.mesh.sharding.attention_specs`;
   constraining the output constrains its gradient too: TE 2.14's backward partition takes the
   output gradient's sharding as it comes, so a gradient laid out otherwise reaches the kernel
   with another shape than q; 2.20 ties it to the output's): the output and dq, dk, dv equal
   plain attention within each document, computed on one device.
3. q split over heads but k, v not (what TE gets when nothing constrains them): TE compiles and
   runs, raises nothing, and pairs query heads with the wrong kv heads (its kernel pairs head h
   with kv head h // (H / G) of the same device): the output is wrong.
Prints "sharded te attention ok".
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROWS = [[3, 1, 4, 8], [16], [2, 2, 2, 10], [1, 15]]
"""Document lengths of the 4 rows (16 tokens each)."""
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _operands():
    documents = np.stack([np.repeat(np.arange(len(r)), r) for r in ROWS]).astype(np.int32)
    positions = np.stack([np.concatenate([np.arange(n) for n in r]) for r in ROWS])
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (len(ROWS), 16)
    q = jax.random.normal(keys[0], (*shape, HEADS, HEAD_DIM), jnp.float32)
    k, v = (jax.random.normal(key, (*shape, KV_HEADS, HEAD_DIM)) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    qkv = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    return (*qkv, jnp.asarray(documents), jnp.asarray(positions.astype(np.int32))), w


def _plain(q, k, v, documents, _positions):
    """Causal GQA within documents, float32, one device: what TE's kernel must compute."""
    b, t, h, d = q.shape
    g = k.shape[2]
    qf = q.astype(jnp.float32).reshape(b, t, g, h // g, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qf, k.astype(jnp.float32)) / np.sqrt(d)
    allowed = jnp.tril(jnp.ones((t, t), bool)) & (documents[:, :, None] == documents[:, None, :])
    probs = jax.nn.softmax(jnp.where(allowed[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v.astype(jnp.float32)).reshape(b, t, h, d)
    return out.astype(q.dtype)


def _loss_and_grads(attend, mesh, heads_spec, kv_spec, w):
    def loss(q, k, v, documents, positions):
        if mesh is not None:
            place = lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))  # noqa: E731
            q, k, v = place(q, heads_spec), place(k, kv_spec), place(v, kv_spec)
            documents, positions = (
                place(documents, P("data", None)),
                place(positions, P("data", None)),
            )
        out = attend(q, k, v, documents, positions)
        if mesh is not None:  # and so its gradient, which TE 2.14's backward takes as it comes
            out = place(out, heads_spec)
        return jnp.sum(out.astype(jnp.float32) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(root: Path, version: str) -> None:
    import te_attention_standin
    import te_standin

    te_standin.import_te_jax(root, version)
    te_attention_standin.install_kernel()
    from nvfp4_ops.te_attention import te_attention
    from nvfp4_ops.te_backend import te_sharding

    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
    operands, w = _operands()

    def attend(q, k, v, documents, positions):
        return te_attention(q, k, v, documents, positions, max_documents=4)

    (_, want), want_grads = _loss_and_grads(_plain, None, None, None, w)(*operands)
    split, whole = P("data", None, "tensor", None), P("data", None, None, None)
    with te_standin.pure_jax_te():
        try:  # 1. no MeshResource, no context mesh
            _loss_and_grads(attend, mesh, split, split, w).lower(*operands).compile()
        except Exception as err:  # noqa: BLE001 - XLA reports TE's AssertionError as its own
            assert "is not a axis of the given mesh" in str(err), err
        else:
            raise AssertionError("TE partitioned fused attention without its mesh context")
        with te_sharding(mesh, data="data", fsdp="fsdp"):
            (_, out), grads = _loss_and_grads(attend, mesh, split, split, w)(*operands)  # 2.
            (_, wrong), _ = _loss_and_grads(attend, mesh, split, whole, w)(*operands)  # 3.
    errors = {"out": _relative(out, want)}
    errors.update({n: _relative(g, r) for n, g, r in zip("qkv", grads, want_grads, strict=True)})
    print(f"sharded te attention vs plain attention, relative errors: {errors}")
    assert all(e < 1e-2 for e in errors.values()), errors  # bfloat16 rounding
    assert len(out.sharding.device_set) == mesh.size, out.sharding
    mixed = _relative(wrong, want)
    print(f"q split over heads, k and v not: relative error {mixed:.2f} (no error raised)")
    assert mixed > 0.1, mixed
    print("sharded te attention ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
