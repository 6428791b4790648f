"""Causal grouped-query attention and its implementations (`model.attention`).

- "naive": the reference. Full float32 [L x L] scores, float32 softmax, probabilities cast to
  v's dtype for SV. Memory O(L^2) per head.
- "xla": `jax.nn.dot_product_attention(implementation="xla")` (also materialises the scores).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN flash attention;
  NVIDIA GPUs only, bfloat16/float16 only.
- "te": TransformerEngine's fused attention (`nvfp4_ops.te_attention`): cuDNN flash attention
  with documents as THD sequences (no [L, L] mask); NVIDIA GPUs with TE installed. UNTESTED ON
  HARDWARE: `nvfp4-train run` checks it against "naive" before a run uses it
  (`nvfp4_train.precision.attention_check`).
- "chunked": `nvfp4_train.model.chunked_attention`, pure-JAX flash attention (online softmax over
  [block x block] tiles, recomputing backward); O(L x block) memory on any device.
- "auto": `resolve_attention`: te where it runs, else cudnn where it runs, else chunked from
  `AUTO_CHUNKED_FROM` tokens, else naive.

Every implementation takes optional `segment_ids` [B, L]: a query sees only keys of its own
document (and, causally, not after itself).

Example:
    >>> q = jnp.ones((1, 4, 2, 8)); kv = jnp.ones((1, 4, 1, 8))
    >>> attention(q, kv, kv, implementation="chunked", block=2).shape
    (1, 4, 2, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.te_attention import te_attention, te_attention_support
from nvfp4_train.model.chunked_attention import chunked_attention

ATTENTION_IMPLEMENTATIONS = ("auto", "naive", "xla", "cudnn", "te", "chunked")
"""The values of `model.attention`."""
AUTO_CHUNKED_FROM = 2048
"""`model.attention: auto` uses "chunked" (where cudnn does not run) from this many tokens on."""
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attention_capability(implementation: str, *, platform: str, dtype=jnp.bfloat16,
                         head_dim: int = 128) -> tuple[bool, str]:  # fmt: skip
    """(whether `implementation` runs here, why not). `platform` is `jax.default_backend()`."""
    if implementation == "te":
        return te_attention_support(platform=platform, dtype=dtype, head_dim=head_dim)
    if implementation != "cudnn":
        return True, ""
    if platform != "gpu":
        return False, f"cuDNN flash attention needs an NVIDIA GPU, this machine runs {platform!r}"
    if jnp.dtype(dtype) not in [jnp.dtype(t) for t in _CUDNN_DTYPES]:
        return False, f"cuDNN flash attention needs bfloat16 or float16, got {jnp.dtype(dtype)}"
    if head_dim % 8 or head_dim > 256:
        return False, f"cuDNN flash attention needs head_dim % 8 == 0 and <= 256, got {head_dim}"
    return True, ""


def resolve_attention(implementation: str, *, seq_len: int, platform: str, dtype=jnp.bfloat16,
                      head_dim: int = 128) -> str:  # fmt: skip
    """The implementation "auto" stands for here (any other name is returned as it is).

    Example:
        >>> resolve_attention("auto", seq_len=128, platform="cpu")
        'naive'
    """
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation != "auto":
        return implementation
    for fused in ("te", "cudnn"):
        if attention_capability(fused, platform=platform, dtype=dtype, head_dim=head_dim)[0]:
            return fused
    return unfused_attention(seq_len)


def unfused_attention(seq_len: int) -> str:
    """What "auto" picks where no fused kernel runs (or none passed its check): chunked from
    `AUTO_CHUNKED_FROM` tokens on, else naive."""
    return "chunked" if seq_len >= AUTO_CHUNKED_FROM else "naive"


def run_attention(cfg, platform: str) -> str:
    """The implementation `cfg.model.attention` stands for in a run of `cfg` (at
    `train.seq_len`, in the model's dtype and head size) on `platform`."""
    m = cfg.model
    return resolve_attention(m.attention, seq_len=cfg.train.seq_len, platform=platform,
                             dtype=m.compute_dtype, head_dim=m.resolved_head_dim)  # fmt: skip


def document_bound(cfg, platform: str) -> int | None:
    """`model.attention_max_documents` where a run of `cfg` on `platform` must hold every batch
    row to it (attention te with a bound below one document per token), else None."""
    bound = cfg.model.attention_max_documents
    bounded = run_attention(cfg, platform) == "te" and 0 < bound < cfg.train.seq_len
    return bound if bounded else None


def too_many_documents(segment_ids_BxL: np.ndarray, bound: int) -> str | None:
    """Why a batch with `segment_ids_BxL` cannot run under `document_bound` `bound`, or None.

    Example:
        >>> too_many_documents(np.array([[0, 1, 2]]), 3) is None
        True
    """
    most = int(documents_per_row(segment_ids_BxL).max())
    if most <= bound:
        return None
    return (
        f"a batch row holds {most} documents, more than model.attention_max_documents={bound} "
        "that attention 'te' is compiled for (documents beyond it would not be attended); raise "
        "it, or set it to 0 (one per token)"
    )


def documents_per_row(segment_ids_BxL: np.ndarray) -> np.ndarray:
    """int [B]: the documents of each packed row (ids rise by one at each new document).

    Example:
        >>> documents_per_row(np.array([[0, 0, 1, 2], [0, 0, 0, 0]])).tolist()
        [3, 1]
    """
    return segment_ids_BxL[:, -1] - segment_ids_BxL[:, 0] + 1


def document_positions(segment_ids_BxL: jax.Array) -> jax.Array:
    """int32 [B, L]: each token's position within its document (0 where a new id starts).

    Example:
        >>> document_positions(jnp.array([[0, 0, 0, 1, 1, 2]])).tolist()
        [[0, 1, 2, 0, 1, 0]]
    """
    l = segment_ids_BxL.shape[1]
    index_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), segment_ids_BxL.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids_BxL[:, :1], bool),
         segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1,
    )  # fmt: skip
    start_BxL = jax.lax.cummax(jnp.where(starts, index_BxL, 0), axis=1)
    return index_BxL - start_BxL


def naive_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
    """Causal softmax attention; each of the G kv heads serves H/G consecutive query heads.

    Scores and softmax in float32; the probabilities are cast back to the input dtype for SV.
    """
    b, l, h, d = q_BxLxHxK.shape
    g = k_BxLxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, d)
    scores_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxLxGxK, preferred_element_type=jnp.float32
    ) / jnp.sqrt(jnp.float32(d))
    causal_LxS = jnp.tril(jnp.ones((l, l), dtype=bool))
    if segment_ids_BxL is not None:
        same_BxLxS = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
        causal_LxS = (causal_LxS & same_BxLxS)[:, None, None]
    scores_BxGxRxLxS = jnp.where(causal_LxS, scores_BxGxRxLxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxGxRxLxS, axis=-1).astype(v_BxLxGxK.dtype)
    out_BxLxGxRxK = jnp.einsum(
        "bgrls,bsgk->blgrk", probs, v_BxLxGxK, preferred_element_type=jnp.float32
    )
    return out_BxLxGxRxK.reshape(b, l, h, d).astype(q_BxLxHxK.dtype)


def fused_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None,
    implementation: str,
) -> jax.Array:
    """`jax.nn.dot_product_attention` ("xla" or "cudnn"), causal, GQA, documents as a mask."""
    mask = None
    if segment_ids_BxL is not None:
        mask = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask=mask, is_causal=True, implementation=implementation
    )


def attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
    *,
    implementation: str = "naive",
    block: int = 512,
    max_documents: int = 0,
) -> jax.Array:
    """Causal GQA with the implementation `model.attention` names ("auto" resolved here).

    Args:
        q_BxLxHxK: queries; H a multiple of G.
        k_BxLxGxK, v_BxLxGxK: keys and values.
        segment_ids_BxL: int document ids, or None (one document per row).
        implementation: one of `ATTENTION_IMPLEMENTATIONS`.
        block: "chunked": the tile size (`model.attention_block`).
        max_documents: "te": the most documents a row holds (`model.attention_max_documents`;
            0: one per token, always enough).

    Raises:
        ValueError: an unknown implementation, or one that cannot run here (one line).
    """
    platform = jax.default_backend()
    dtype, head_dim = q_BxLxHxK.dtype, q_BxLxHxK.shape[-1]
    name = resolve_attention(implementation, seq_len=q_BxLxHxK.shape[1], platform=platform,
                             dtype=dtype, head_dim=head_dim)  # fmt: skip
    ok, why = attention_capability(name, platform=platform, dtype=dtype, head_dim=head_dim)
    if not ok:
        raise ValueError(f"model.attention={name!r} cannot run here: {why}")
    if name == "naive":
        return naive_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL)
    if name == "chunked":
        return chunked_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, block)
    if name == "te":
        positions = None if segment_ids_BxL is None else document_positions(segment_ids_BxL)
        return te_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, positions,
                            max_documents=max_documents or q_BxLxHxK.shape[1])  # fmt: skip
    return fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, name)
