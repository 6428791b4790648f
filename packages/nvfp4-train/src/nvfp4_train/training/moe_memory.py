"""What an MoE block's MLP keeps for the backward pass, for `show-config --memory` (`memory`).

Per MoE block and microbatch, one device dispatches and combines T tokens and runs its routed
experts on R rows: without expert parallelism T = T_l, its own tokens, and R = T_l k (every
assignment); with `mesh.expert` > 1 (`model.expert_parallel`) its E_d = ceil(E / |expert| /
|data fsdp|) experts take their rows of the T_g = T_l x |data fsdp expert| tokens of the whole
batch in the static buffer of `expert_layout.local_rows` (R = min(T_g min(k, E_d), E_d
capacity)): every row its experts could take, so the estimate holds however the router
balances; T is T_l with the all-to-all exchange (`model.moe.dispatch`, the default: it sends
its own tokens' rows) and T_g with the all-gather one (it gathers the whole batch). By
`model.remat` (d = d_model, F = expert_mlp_dim, S = the shared experts' width, w = the experts'
width (d, or the latent l of LatentMoE), g = 2 for SwiGLU experts and 1 for relu2, c =
compute-dtype bytes, p = 9/16 for a quantized block, else as `memory` says):

    full           nothing (the block input is counted with the block)
    quantized      the grouped GEMMs' FP4 operands R (w + F) p, the shared experts' T_l (d + S) p,
                   LatentMoE's projections' T_l (d + l) p
    dots_no_batch  + their outputs R (gF + w) c + T_l (gS + d) c + T_l (l + d) c, the router
                   logits T_l E 4
    dots           as dots_no_batch
    none           + the activations R (g+1)F c + T_l (g+1)S c, the dispatch buffers (the
                   gathered tokens T w c, the dispatched rows R w c, the combined float32 output
                   T w 4) and the router probabilities T_l E 4

in place of a dense MLP's (d + f) p, (2f + d) c and 3f c per token (`dense_mlp_per_token`).

Beyond what it keeps, one MoE block at a time holds its routed experts' working buffers, the
largest transient of an MoE model (`routed_buffers`, in the printed breakdown by name; per
device, T and R as above, k = experts_per_token, E_d the experts one device runs (E without
expert parallelism), R_p = the grouped GEMM's padded rows, every expert's rows padded to the
tile of max(alignment, 16) rows (`nvfp4_ops.grouped.layout`), q = 4 + 9/16 for a quantized
block (an FP4 copy and its float32 decode), all counted live at once:

    dispatch: the routed tokens [T, D]                T d c       (T_g all-gathered, or T_l)
    dispatch: the sorted token rows [R, D]            R d c
    grouped GEMM: the largest of the six GEMMs        R_p K c + (R_p (K + N) + E_d K N) q
      (gate_up K = d, N = 2F; down K = F, N = d):     (BF16: R_p K c + E_d K N c + R_p N 4)
      its token tiles in the compute dtype, both operands' FP4 copies and float32 decodes (the
      emulated and xla backends decode them: `nvfp4_ops.grouped.qdot`) and the float32 output
    the experts' outputs in assignment order [T k, D] T k d c
    combine: the k outputs per token [T, k, D]         T k d 4     (float32)

Not counted: the backward pass's float32 cotangents of the outputs and the tokens ([T k, D],
[T, D]), the stochastic-rounding bits of the gradients' GEMM operands, the all-to-all's sorted
rows before it sends them ([T_l k, D], fewer than R), and buffers XLA allocates ahead of their
use. On XLA:CPU one compiled MoE block's forward and backward holds 2.4-2.6x this
sum, at every k and T measured (docs/benchmarks/moe_memory.md).

Example:
    >>> from nvfp4_train.config.run_config import config_from_dict
    >>> cfg = config_from_dict({"model": {"moe": {"num_experts": 8, "expert_mlp_dim": 64}},
    ...                         "mesh": {"data": 2, "expert": 4}})
    >>> sizes = {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    >>> routed_rows(cfg, sizes, tokens=128)  # all-to-all: its 128 tokens, the 1024 of one expert
    (128, 1024)
    >>> gather = config_from_dict({"model": {"moe": {"num_experts": 8, "expert_mlp_dim": 64,
    ...                                              "dispatch": "all_gather"}},
    ...                            "mesh": {"data": 2, "expert": 4}})
    >>> routed_rows(gather, sizes, tokens=128)  # all-gather: the batch's 1024 tokens
    (1024, 1024)
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from nvfp4_train.mesh_axes import EXPERT_AXIS, TOKEN_AXES
from nvfp4_train.model.config import is_moe_block
from nvfp4_train.model.moe.config import expert_capacity
from nvfp4_train.model.moe.expert_layout import local_rows

FP4_BYTES = 9 / 16
F32 = 4
MIN_TILE_ROWS = 16
"""The fewest rows of a grouped GEMM's tile (`nvfp4_ops.grouped.layout.MIN_TILE_ROWS`)."""


def device_experts(cfg, sizes: dict[str, int]) -> int:
    """E_d: the experts one device runs its grouped GEMMs on (all E without expert parallelism;
    `expert_parallel`'s share of one replica otherwise)."""
    experts = cfg.model.moe.num_experts
    if sizes[EXPERT_AXIS] == 1:
        return experts
    replicas = math.prod(sizes[a] for a in TOKEN_AXES if a != EXPERT_AXIS)
    return -(-experts // sizes[EXPERT_AXIS] // replicas)


def routed_rows(cfg, sizes: dict[str, int], tokens: int) -> tuple[int, int]:
    """(T: the tokens one device's MoE dispatch holds, R: the rows of its grouped GEMMs) for
    `tokens` tokens per device and microbatch on a mesh of `sizes` (module doc)."""
    moe = cfg.model.moe
    k = moe.experts_per_token
    if sizes[EXPERT_AXIS] == 1:
        return tokens, tokens * k
    batch = tokens * math.prod(sizes[a] for a in TOKEN_AXES)
    rows = local_rows(batch, k, device_experts(cfg, sizes), expert_capacity(moe, batch))
    return (tokens if moe.dispatch == "all_to_all" else batch), rows


def padded_rows(rows: int, experts: int, alignment: int) -> int:
    """R_p: the rows of the grouped GEMM's padded buffer for `rows` rows of `experts` groups
    (`nvfp4_ops.grouped.layout.GroupShape.rows`: any group sizes fit)."""
    a = max(alignment, MIN_TILE_ROWS)
    return max(1, (rows + experts * (a - 1)) // a) * a


def expert_width(cfg) -> int:
    """w: the routed experts' input and output width (d_model, or LatentMoE's latent)."""
    return cfg.model.moe.latent_dim or cfg.model.d_model


def first_linear_outputs(moe) -> int:
    """g: the experts' first linear's outputs per hidden unit (2: SwiGLU's gate | up; 1: relu2)."""
    return 2 if moe.expert_activation == "swiglu" else 1


def _gemm_bytes(cfg, recipe, padded: int, experts: int, k_n: tuple[int, int]) -> float:
    """One grouped GEMM's buffers (module doc) for a linear [K, N] of `recipe`."""
    c, (k, n) = jnp.dtype(cfg.model.compute_dtype).itemsize, k_n
    if recipe.quantized:
        return padded * k * c + (padded * (k + n) + experts * k * n) * (F32 + FP4_BYTES)
    return padded * k * c + experts * k * n * c + padded * n * F32


def routed_buffers(cfg, recipes, sizes: dict[str, int], tokens: int) -> dict[str, float]:
    """{buffer: bytes} one device holds at once while one MoE block runs its routed experts
    (module doc), for `tokens` tokens per device and microbatch on a mesh of `sizes`, the
    block's experts running `recipes` (the first linear's and down's `nvfp4_ops.Recipe`); D is
    the experts' width (LatentMoE: the latent)."""
    m, moe = cfg.model, cfg.model.moe
    c, f = jnp.dtype(m.compute_dtype).itemsize, moe.expert_mlp_dim
    d, g = expert_width(cfg), first_linear_outputs(moe)
    k = moe.experts_per_token
    seen, rows = routed_rows(cfg, sizes, tokens)
    experts = device_experts(cfg, sizes)
    shapes = ((d, g * f), (f, d))  # gate_up (relu2: up), down: [K, N]
    gemm = max(
        _gemm_bytes(cfg, r, padded_rows(rows, experts, r.alignment), experts, shape)
        for r, shape in zip(recipes, shapes, strict=True)
    )
    return {
        "dispatch: the routed tokens [T, D]": seen * d * c,
        "dispatch: the sorted token rows [R, D]": rows * d * c,
        "grouped GEMM: operands, FP4 copies, float32 decodes and output": gemm,
        "the experts' outputs in assignment order [T k, D]": seen * k * d * c,
        "combine: the k outputs per token [T, k, D] (float32)": seen * k * d * F32,
    }


def _per_element(cfg, quantized: bool) -> float:
    c = jnp.dtype(cfg.model.compute_dtype).itemsize
    return FP4_BYTES if quantized else (c if cfg.model.remat == "none" else 0)


def dense_mlp_per_token(cfg, quantized: bool) -> float:
    """Bytes per token a dense MLP keeps under `model.remat` (its part of `memory`'s rows)."""
    m, remat = cfg.model, cfg.model.remat
    c, d, f = jnp.dtype(m.compute_dtype).itemsize, m.d_model, m.mlp_dim
    if remat == "full":
        return 0
    saved = (d + f) * _per_element(cfg, quantized)
    if remat in ("dots_no_batch", "dots", "none"):
        saved += (2 * f + d) * c
    return saved + (3 * f * c if remat == "none" else 0)


def mlp_correction(cfg, index: int, quantized: bool, sizes: dict[str, int], tokens: int) -> float:
    """What block `index`'s MLP keeps beyond `memory`'s dense-MLP rows: 0 for a dense block, the
    MoE MLP's bytes less a dense MLP's for an MoE block."""
    if not is_moe_block(cfg.model, index):
        return 0
    return moe_mlp_bytes(cfg, quantized, sizes, tokens) - tokens * dense_mlp_per_token(
        cfg, quantized
    )


def moe_mlp_bytes(cfg, quantized: bool, sizes: dict[str, int], tokens: int) -> float:
    """Bytes one device's MoE MLP of one block keeps for the backward pass (module doc), for
    `tokens` tokens per device and microbatch on a mesh of `sizes`."""
    m, moe, remat = cfg.model, cfg.model.moe, cfg.model.remat
    c, d, f, s = (
        jnp.dtype(m.compute_dtype).itemsize,
        m.d_model,
        moe.expert_mlp_dim,
        moe.shared_mlp_dim,
    )
    w, lat, g = expert_width(cfg), moe.latent_dim, first_linear_outputs(moe)
    seen, rows = routed_rows(cfg, sizes, tokens)
    if remat == "full":
        return 0
    p = _per_element(cfg, quantized)
    saved = rows * (w + f) * p + (tokens * (d + s) * p if s else 0)
    saved += tokens * (d + lat) * p if lat else 0
    if remat in ("dots_no_batch", "dots", "none"):
        saved += rows * (g * f + w) * c + tokens * ((g * s + d) * c if s else 0)
        saved += tokens * moe.num_experts * 4 + (tokens * (lat + d) * c if lat else 0)
    if remat == "none":
        saved += rows * (g + 1) * f * c + tokens * (g + 1) * s * c
        saved += seen * w * c + rows * w * c + seen * w * 4 + tokens * moe.num_experts * 4
    return saved
