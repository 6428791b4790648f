"""TransformerEngine's fused attention (cuDNN), as `nvfp4-train`'s `model.attention: te` calls it.

UNTESTED ON HARDWARE. What is verified, and where:
- every TransformerEngine name, keyword argument and enum member this module uses is checked
  against the JAX sources of the pinned TE releases (`nox -s te_conformance`, test_te_api.py;
  parsed, not imported: TE's JAX package needs CUDA to import);
- TE's JAX code down to the cuDNN call runs on CPU over a stand-in for the kernel and its
  extension (conformance/te_attention_standin.py): one device, and partitioned over 4 fake
  devices (sharded_te_attention.py, see "Sharded calls" below);
- on the user's machine, `nvfp4-train run` compares it with the reference attention (outputs and
  gradients, with documents and grouped-query heads) before a run uses it
  (`nvfp4_train.precision.attention_check`), and leaves it out if they disagree or it crashes.

Causal grouped-query attention over packed documents is TE's THD layout (q, k and v each
[B, L, heads, head_dim], documents packed in each row) with a padding-causal mask: TE's
`SequenceDescriptor.from_segment_ids_and_pos` takes 1-based document ids (0 is padding) and each
token's position within its document, and cuDNN attends within a document only. Rows without
documents are one document. `max_documents` (static) bounds the documents of any row: cuDNN
gets one sequence slot per document (its batch becomes B x max_documents; TE: compile time and
memory are proportional to it), and documents beyond the bound are not attended: TE gives their
tokens output 0 (nvfp4-train checks every batch against it on the host).

Sharded calls: TE's partition rule takes the operands' shardings as they come. Its kernel pairs
query head h with kv head h // (H / G) of the SAME device, so q, k and v must be split alike over
heads (or not at all), and the segment ids like q's rows; TE raises nothing otherwise
(`nvfp4_train.mesh.sharding.attention_specs` decides; `conformance/sharded_te_attention.py`
shows both). A call on several devices must be traced and compiled inside
`nvfp4_ops.te_sharding` (TE's mesh and `MeshResource`): without it TE takes the context-parallel
axis to be "" and its partition asserts '"" is not a axis of the given mesh'.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.backends import compute_capability
from nvfp4_ops.te_backend import te_version_problem

TE_ATTENTION_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""What cuDNN's fused attention takes as q, k and v."""
MAX_HEAD_DIM = 128
"""The largest head dimension TE's fused attention runs forward and backward on every GPU."""
HEAD_DIM_MULTIPLE = 16
"""head_dim % 16 != 0 puts cuDNN's THD backward on a path with a token-sized float32 dQ
accumulator, B x max_documents x L x H x head_dim (read from TE's sources, see docs/attention.md)."""
MIN_COMPUTE_CAPABILITY = (9, 0)
"""cuDNN runs ragged (THD) sequences on sm_90 (Hopper) and newer only."""
MIN_CUDNN = 90600
"""cuDNN 9.6: THD with grouped-query heads, and no token-sized dQ accumulator in the backward."""
RESIDUAL_NAME = "context"
"""TE's name (`checkpoint_name`) of the forward's output, softmax statistics and RNG state."""


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """What decides which fused attention kernels a CUDA GPU runs.

    Attributes:
      compute_capability: (major, minor), e.g. (9, 0) for H100; the lowest of the local GPUs.
      cudnn_version: as cuDNN reports it (90600 for 9.6.0), or None if it could not be read.
    """

    compute_capability: tuple[int, int]
    cudnn_version: int | None = None


@functools.cache
def local_gpu_facts() -> GpuFacts | None:
    """This host's `GpuFacts` (the cuDNN jax loaded), or None without CUDA GPUs."""
    ccs = [cc for d in jax.local_devices() if (cc := compute_capability(d)) is not None]
    if not ccs:
        return None
    try:
        from jax._src.lib import cuda_versions  # the cuDNN jax and TE's kernels run

        cudnn = int(cuda_versions.cudnn_get_version()) if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 - an unreadable version is "unknown", not an error
        cudnn = None
    return GpuFacts(min(ccs), cudnn)


def _te_attention():
    """transformer_engine.jax.attention (fused_attn, its enums, SequenceDescriptor)."""
    return importlib.import_module("transformer_engine.jax.attention")


@functools.cache
def _import_problem() -> str | None:
    """Why transformer_engine.jax.attention does not import here (None: it does); asked once."""
    try:
        _te_attention()
    except Exception as e:  # noqa: BLE001 - TE without CUDA raises more than ImportError
        return f"transformer_engine.jax.attention does not import: {type(e).__name__}: {e}"
    return te_version_problem()


def te_attention_support(
    *, platform: str, dtype, head_dim: int, num_heads: int = 1, num_kv_heads: int = 1,
    gpu: GpuFacts | None = None,
) -> tuple[bool, str]:  # fmt: skip
    """(whether TE's fused attention can run here, why not): an NVIDIA GPU of sm_90 or newer
    with cuDNN >= 9.6 (`MIN_COMPUTE_CAPABILITY`, `MIN_CUDNN`), TE >= 2.14 importable,
    bfloat16/float16, head_dim a multiple of 16 and <= 128. Whether cuDNN has a kernel for a run's
    exact shape shows when it runs: `nvfp4-train run` runs it on the run's shapes before step 1
    and leaves it out if it fails (`nvfp4_train.precision.attention_check`).

    Args:
      platform: `jax.default_backend()`.
      dtype: the dtype of q, k and v.
      head_dim: the head dimension.
      num_heads, num_kv_heads: query and key/value heads (they name the grouped-query case).
      gpu: the GPU's facts (`local_gpu_facts()`); None: not known (a GPU that has them).
    """
    if platform != "gpu":
        return False, f"TE fused attention needs an NVIDIA GPU, this machine runs {platform!r}"
    if np.dtype(dtype) not in TE_ATTENTION_DTYPES:
        return False, f"TE fused attention needs bfloat16 or float16, got {np.dtype(dtype)}"
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        return False, (
            f"TE fused attention needs head_dim % {HEAD_DIM_MULTIPLE} == 0 and <= {MAX_HEAD_DIM}, "
            f"got {head_dim}"
        )
    problem = _gpu_problem(gpu, grouped=num_heads != num_kv_heads)
    if problem is None:
        problem = _import_problem()
    return (False, problem) if problem is not None else (True, "")


def _gpu_problem(gpu: GpuFacts | None, *, grouped: bool) -> str | None:
    if gpu is None:
        return None
    major, minor = gpu.compute_capability
    if gpu.compute_capability < MIN_COMPUTE_CAPABILITY:
        return (
            "TE fused attention over packed documents (THD) needs sm_90 or newer, this GPU is "
            f"sm_{major}{minor}"
        )
    version = gpu.cudnn_version
    if version is not None and version < MIN_CUDNN:
        why = "grouped-query heads need it; " if grouped else ""
        return (
            f"TE fused attention over packed documents needs cuDNN >= 9.6 ({why}older ones give "
            "the backward a token-sized dQ accumulator), this host has "
            f"{version // 10000}.{version // 100 % 100}.{version % 100}"
        )
    return None


def te_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    document_BxL: jax.Array | None = None,
    position_BxL: jax.Array | None = None,
    *,
    max_documents: int = 1,
    residual_name: str = RESIDUAL_NAME,
) -> jax.Array:
    """Causal GQA through TE's fused attention, attending within documents.

    Args:
      q_BxLxHxK: queries (bfloat16 or float16); H a multiple of G.
      k_BxLxGxK, v_BxLxGxK: keys and values.
      document_BxL: int document index of each token, 0 for a row's first document and rising
        by one at each new one (nvfp4-train's `segment_ids`), or None (each row one document).
      position_BxL: each token's position within its document (needed with `document_BxL`).
      max_documents: the most documents any row holds (static; ignored without documents).
      residual_name: the `checkpoint_name` of what the backward keeps from the forward (output,
        softmax statistics, RNG state), for `jax.checkpoint` policies that keep it.

    Returns:
      [B, L, H, K] in q's dtype.
    """
    attn = _te_attention()
    ids_BxL, position_BxL = te_segments(document_BxL, position_BxL, q_BxLxHxK.shape[:2])
    descriptor = attn.SequenceDescriptor.from_segment_ids_and_pos(ids_BxL, position_BxL)
    return attn.fused_attn(
        (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK), None, descriptor, None,
        attn_bias_type=attn.AttnBiasType.NO_BIAS,
        attn_mask_type=attn.AttnMaskType.PADDING_CAUSAL_MASK,
        qkv_layout=attn.QKVLayout.THD_THD_THD,
        softmax_type=attn.AttnSoftmaxType.VANILLA_SOFTMAX,
        scaling_factor=1.0 / math.sqrt(q_BxLxHxK.shape[-1]), dropout_probability=0.0,
        is_training=True, max_segments_per_seq=1 if document_BxL is None else max_documents,
        context_checkpoint_name=residual_name,
    )  # fmt: skip


def te_segments(
    document_BxL: jax.Array | None, position_BxL: jax.Array | None, shape: tuple[int, int]
) -> tuple[jax.Array, jax.Array]:
    """(segment ids, segment positions) int32 [B, L] as TE's `SequenceDescriptor` takes them:
    ids 1, 2, ... per document of a row (0 would be padding), positions from 0 in each.

    Example:
        >>> ids, pos = te_segments(jnp.array([[0, 0, 1, 2, 2]]), jnp.array([[0, 1, 0, 0, 1]]), (1, 5))
        >>> ids.tolist(), pos.tolist()
        ([[1, 1, 2, 3, 3]], [[0, 1, 0, 0, 1]])
    """
    b, l = shape
    if document_BxL is None:
        position_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        return jnp.ones((b, l), jnp.int32), position_BxL
    ids_BxL = document_BxL - document_BxL[:, :1] + 1
    return ids_BxL.astype(jnp.int32), position_BxL.astype(jnp.int32)
