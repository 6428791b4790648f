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
- "chunked": `nvfp4_train.model.blocks.chunked_attention`, pure-JAX flash attention (online softmax over
  [block x block] tiles, recomputing backward); O(L x block) memory on any device.
- "auto": `resolve_attention`: te where it runs, else cudnn where it runs (not for masked rows
  from `AUTO_CHUNKED_FROM` tokens on where jax gives cudnn a dense mask, `cudnn_mask_is_dense`),
  else chunked from `AUTO_CHUNKED_FROM` tokens, else naive. Where each runs: `attention_capability`
  (platform, dtype, head size, and on a GPU its compute capability and cuDNN version).

Under a device mesh the fused kernels get q, k, v and the segment ids through the run's
`constrain("attention", ...)` (`mesh.sharding.attention_specs`: heads split over `tensor` only
when it divides both head counts). With remat, `SAVES_ATTENTION` keeps what their backward reads.

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

from nvfp4_ops.te_attention import GpuFacts, local_gpu_facts, te_attention, te_attention_support
from nvfp4_train.model.blocks.chunked_attention import chunked_attention

ATTENTION_IMPLEMENTATIONS = ("auto", "naive", "xla", "cudnn", "te", "chunked")
"""The values of `model.attention`."""
FUSED_KERNELS = ("te", "cudnn")
"""The fused kernels "auto" tries, in this order, where they run (and the order a run falls back
through when one fails its check)."""
AUTO_CHUNKED_FROM = 2048
"""`model.attention: auto` uses "chunked" (where no fused kernel runs) from this many tokens on;
also where "cudnn" would hold a dense document mask (`cudnn_mask_is_dense`)."""
ATTENTION_RESIDUALS = "attention_residuals"
"""`checkpoint_name` of what the backward of "te" and "chunked" reads from the forward (output,
softmax statistics): the "dots" remat policies keep it (`SAVES_ATTENTION`)."""
CUDNN_FORWARD = "dot_product_attention_fwd_wrapper"
"""jax's primitive for the cuDNN forward (its outputs are what the backward reads)."""
CUDNN_DENSE_MASK_UNTIL = (0, 10, 2)
"""jax <= this turns a "cudnn" mask into an additive [B, 1, L, L] bias whose [B, 1, L, L]
gradient the backward always computes and writes (fixed upstream after 0.10.2, jax PR 39512)."""
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_mask_is_dense(jax_version: str = jax.__version__) -> bool:
    """Whether "cudnn" with documents holds O(L^2) memory on this jax (`CUDNN_DENSE_MASK_UNTIL`).

    Example:
        >>> cudnn_mask_is_dense("0.10.2"), cudnn_mask_is_dense("0.10.3")
        (True, False)
    """
    release = tuple(int(p) for p in jax_version.split(".")[:3] if p.isdigit())
    return release <= CUDNN_DENSE_MASK_UNTIL


def _saves_cudnn_forward(prim, *_, **__) -> bool:
    return prim.name == CUDNN_FORWARD


SAVES_ATTENTION = jax.checkpoint_policies.save_from_both_policies(
    _saves_cudnn_forward, jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS)
)
"""A `jax.checkpoint` policy that keeps what fused attention's backward reads from its forward
(the cuDNN forward's outputs; `ATTENTION_RESIDUALS` of "te" and "chunked"), so that remat does
not run the forward twice. Custom calls and loops are not dots: `dots_saveable` alone keeps none
of it. q, k, v and a dense mask are recomputed (RoPE, a comparison), never kept."""


def host_gpu(platform: str) -> GpuFacts | None:
    """This host's GPU facts when `platform` is the GPU it runs on, else None (not known)."""
    return local_gpu_facts() if platform == "gpu" and jax.default_backend() == "gpu" else None


def attention_capability(implementation: str, *, platform: str, dtype=jnp.bfloat16,
                         head_dim: int = 128, num_heads: int = 1, num_kv_heads: int = 1,
                         gpu: GpuFacts | None = None) -> tuple[bool, str]:  # fmt: skip
    """(whether `implementation` runs here, why not). `platform` is `jax.default_backend()`;
    `gpu` the GPU's compute capability and cuDNN version (None: not known, assumed able)."""
    if implementation == "te":
        return te_attention_support(platform=platform, dtype=dtype, head_dim=head_dim,
                                    num_heads=num_heads, num_kv_heads=num_kv_heads, gpu=gpu)  # fmt: skip
    if implementation != "cudnn":
        return True, ""
    if platform != "gpu":
        return False, f"cuDNN flash attention needs an NVIDIA GPU, this machine runs {platform!r}"
    if jnp.dtype(dtype) not in [jnp.dtype(t) for t in _CUDNN_DTYPES]:
        return False, f"cuDNN flash attention needs bfloat16 or float16, got {jnp.dtype(dtype)}"
    if gpu is not None and gpu.compute_capability < (8, 0):
        major, minor = gpu.compute_capability
        return False, f"cuDNN flash attention needs sm_80 or newer, this GPU is sm_{major}{minor}"
    widest = 128 if gpu is not None and gpu.compute_capability < (9, 0) else 256
    if head_dim % 8 or head_dim > widest:
        return False, (
            f"cuDNN flash attention needs head_dim % 8 == 0 and <= {widest} here, got {head_dim}"
        )
    return True, ""


def fused_kernels(*, seq_len: int, platform: str, dtype=jnp.bfloat16, head_dim: int = 128,
                  num_heads: int = 1, num_kv_heads: int = 1, masked: bool = False,
                  gpu: GpuFacts | None = None) -> tuple[str, ...]:  # fmt: skip
    """The fused kernels "auto" may use here, best first (`FUSED_KERNELS` that run here; not
    "cudnn" for `masked` rows of `AUTO_CHUNKED_FROM` tokens or more where its mask is dense)."""
    shape = {"platform": platform, "dtype": dtype, "head_dim": head_dim, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "gpu": gpu}  # fmt: skip
    dense = masked and seq_len >= AUTO_CHUNKED_FROM and cudnn_mask_is_dense()
    return tuple(
        k for k in FUSED_KERNELS
        if attention_capability(k, **shape)[0] and not (k == "cudnn" and dense)
    )  # fmt: skip


def resolve_attention(implementation: str, *, seq_len: int, platform: str, dtype=jnp.bfloat16,
                      head_dim: int = 128, num_heads: int = 1, num_kv_heads: int = 1,
                      masked: bool = False, gpu: GpuFacts | None = None) -> str:  # fmt: skip
    """The implementation "auto" stands for here (any other name is returned as it is):
    the first of `fused_kernels`, else `unfused_attention(seq_len)`.

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
    fused = fused_kernels(seq_len=seq_len, platform=platform, dtype=dtype, head_dim=head_dim,
                          num_heads=num_heads, num_kv_heads=num_kv_heads, masked=masked, gpu=gpu)  # fmt: skip
    return fused[0] if fused else unfused_attention(seq_len)


def unfused_attention(seq_len: int) -> str:
    """What "auto" picks where no fused kernel runs (or none passed its check): chunked from
    `AUTO_CHUNKED_FROM` tokens on, else naive."""
    return "chunked" if seq_len >= AUTO_CHUNKED_FROM else "naive"


def run_shape(cfg, platform: str) -> dict:
    """The keywords of `resolve_attention` / `fused_kernels` for a run of `cfg` on `platform`
    (rows count as masked unless `data.document_mask` is false)."""
    m = cfg.model
    return {
        "seq_len": cfg.train.seq_len, "platform": platform, "dtype": m.compute_dtype,
        "head_dim": m.resolved_head_dim, "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
        "masked": cfg.data.document_mask is not False, "gpu": host_gpu(platform),
    }  # fmt: skip


def run_attention(cfg, platform: str) -> str:
    """The implementation `cfg.model.attention` stands for in a run of `cfg` (at
    `train.seq_len`, in the model's dtype and heads) on `platform`."""
    return resolve_attention(cfg.model.attention, **run_shape(cfg, platform))


def document_bound(cfg, platform: str) -> int | None:
    """`model.attention_max_documents` where a run of `cfg` on `platform` must hold every batch
    row to it (attention te with a bound below one document per token), else None."""
    bound = cfg.model.attention_max_documents
    bounded = run_attention(cfg, platform) == "te" and 0 < bound < cfg.train.seq_len
    return bound if bounded else None


def too_many_documents(
    segment_ids_BxL: np.ndarray, bound: int, batch: str = "a batch"
) -> str | None:
    """Why a batch with `segment_ids_BxL` cannot run under `document_bound` `bound`, or None.
    `batch` names it in the message ("a batch", "validation batch 3").

    Example:
        >>> too_many_documents(np.array([[0, 1, 2]]), 3) is None
        True
    """
    most = int(documents_per_row(segment_ids_BxL).max())
    if most <= bound:
        return None
    return (
        f"{batch} row holds {most} documents, more than model.attention_max_documents={bound} "
        "that attention 'te' is compiled for (TE gives the tokens of documents beyond it output "
        "0: a wrong loss, silently); raise it, or set it to 0 (counted from the data)"
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
    constrain=None,
) -> jax.Array:
    """Causal GQA with the implementation `model.attention` names ("auto" resolved here).

    Args:
        q_BxLxHxK: queries; H a multiple of G.
        k_BxLxGxK, v_BxLxGxK: keys and values.
        segment_ids_BxL: int document ids, or None (one document per row).
        implementation: one of `ATTENTION_IMPLEMENTATIONS`.
        block: "chunked": the tile size (`model.attention_block`).
        max_documents: "te": the most documents a row holds (`model.attention_max_documents`
            after a run resolved it; 0: one per token, always enough and the most expensive).
        constrain: the run's `constrain(kind, x)` (`mesh.sharding.activation_constraint`): the
            fused kernels get q, k, v and the segment ids through `constrain("attention", ...)`,
            and their output goes through it too (their partition rules take operand shardings
            as they come); None: as they are.

    Raises:
        ValueError: an unknown implementation, or one that cannot run here (one line).
    """
    platform, (_, l, h, d), g = jax.default_backend(), q_BxLxHxK.shape, k_BxLxGxK.shape[2]
    shape = {"platform": platform, "dtype": q_BxLxHxK.dtype, "head_dim": d, "num_heads": h,
             "num_kv_heads": g, "gpu": host_gpu(platform)}  # fmt: skip
    name = resolve_attention(implementation, seq_len=l, masked=segment_ids_BxL is not None,
                             **shape)  # fmt: skip
    ok, why = attention_capability(name, **shape)
    if not ok:
        raise ValueError(f"model.attention={name!r} cannot run here: {why}")
    if name in FUSED_KERNELS and constrain is not None:
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL = constrain(
            "attention", (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL)
        )
        out_BxLxHxK = _implementation(name, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL,
                                      block, max_documents)  # fmt: skip
        # the output laid out like q, and so its gradient: TE 2.14's backward partition takes
        # the output gradient's sharding as it comes (2.20 ties it to the output's)
        return constrain("attention", (out_BxLxHxK, k_BxLxGxK, v_BxLxGxK, None))[0]
    return _implementation(name, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, block,
                           max_documents)  # fmt: skip


def _implementation(name: str, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, block: int,
                    max_documents: int) -> jax.Array:  # fmt: skip
    """`attention` by the resolved implementation `name`."""
    if name == "naive":
        return naive_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL)
    if name == "chunked":
        return chunked_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, block,
                                 ATTENTION_RESIDUALS)  # fmt: skip
    if name == "te":
        positions = None if segment_ids_BxL is None else document_positions(segment_ids_BxL)
        return te_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, positions,
                            max_documents=max_documents or q_BxLxHxK.shape[1],
                            residual_name=ATTENTION_RESIDUALS)  # fmt: skip
    return fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, name)
