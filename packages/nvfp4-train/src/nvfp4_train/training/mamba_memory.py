"""What a hybrid model's blocks keep for the backward pass, by kind, for `show-config --memory`.

A hybrid block (`model.pattern`) is `x + mixer(norm(x))`: it keeps its input (d c per token, as
every block) and what its one mixer keeps. Per token, by `model.remat` (d = d_model, c = bytes of
the compute dtype, p = 9/16 for a quantized block, else c without remat and 0 with it; Mamba: W =
in_proj width, X = conv channels (x|B|C), I = d_inner = H P, H heads of width P, G groups, N state,
Q = chunk_size; the scan runs in float32, 4 bytes):

    Mamba block
      quantized      the FP4 operands of in_proj and out_proj:        (d + I) p
      dots_no_batch  + in_proj's and out_proj's outputs:                (W + d) c
      dots           + the scan's einsums (batched): scores C B^T,      (G Q + 2 I + H P N / Q) 4
                       y_diag, y_off, the chunk states
      none           + the conv input and output (before and after      3 X 4 + H 4
                       SiLU) and dt
                     + the decay and its segment sums [B, C, G, R, Q, Q] 2 H Q 4
                     + the states carried into each chunk [B, C, H, P, N] H P N / Q 4
                     + y and the gated norm's input                     2 I 4 + I c
    attention block  a Llama block's attention rows (`memory`)
    MLP block        SwiGLU as `moe_memory.dense_mlp_per_token`; relu2: (d + f) p, its
                     outputs (f + d) c, and without remat relu and its square 2 f c
    MoE block        `moe_memory.moe_mlp_bytes`

The scan's per-chunk buffers grow as L x Q (decay and scores) and L / Q (chunk states), linearly
in the sequence length either way (`scan_buffers` names them for the printed breakdown).

Example:
    >>> from nvfp4_train.config.run_config import config_from_dict
    >>> cfg = config_from_dict({"model": {"architecture": "nemotron_h", "pattern": "M*",
    ...     "num_layers": 2, "remat": "none", "mamba": {"num_heads": 16, "head_dim": 8,
    ...     "state_dim": 16, "n_groups": 2, "chunk_size": 16}}, "train": {"seq_len": 64}})
    >>> scan_buffers(cfg, tokens=64)["decay and segment sums [B, C, G, R, Q, Q]"]  # 2 H Q 4 / token
    131072.0
"""

from __future__ import annotations

import jax.numpy as jnp

FP4_BYTES = 9 / 16
F32 = 4


def _compute_bytes(cfg) -> int:
    return jnp.dtype(cfg.model.compute_dtype).itemsize


def _per_element(cfg, quantized: bool) -> float:
    return FP4_BYTES if quantized else (_compute_bytes(cfg) if cfg.model.remat == "none" else 0)


def scan_buffers(cfg, tokens: int) -> dict[str, float]:
    """{buffer: bytes} the chunked SSD scan of one Mamba block keeps for `tokens` tokens (per
    device and microbatch) under `model.remat` (module doc: the `dots` and `none` rows); empty
    for the other policies."""
    remat, mamba = cfg.model.remat, cfg.model.mamba
    if remat not in ("dots", "none"):
        return {}
    h, p, g, n, q = (
        mamba.num_heads,
        mamba.head_dim,
        mamba.n_groups,
        mamba.state_dim,
        mamba.chunk_size,
    )
    chunks = -(-cfg.train.seq_len // q)
    sequences = tokens / cfg.train.seq_len
    per_chunk = sequences * chunks  # [B, C] of the chunked tensors
    buffers = {
        "scores C B^T [B, C, G, Q, Q]": per_chunk * g * q * q * F32,
        "y_diag and y_off [B, L, H, P]": tokens * 2 * h * p * F32,
        "chunk states [B, chunks, H, P, N]": per_chunk * h * p * n * F32,
    }
    if remat == "none":
        buffers["decay and segment sums [B, C, G, R, Q, Q]"] = per_chunk * 2 * h * q * q * F32
        buffers["states carried in [B, chunks, H, P, N]"] = per_chunk * h * p * n * F32
    return buffers


def mamba_block_bytes(cfg, quantized: bool, tokens: int) -> float:
    """Bytes one Mamba block keeps for the backward beyond its input (module doc)."""
    m, remat, c = cfg.model, cfg.model.remat, _compute_bytes(cfg)
    mamba = m.mamba
    if remat == "full":
        return 0.0
    saved = tokens * (m.d_model + mamba.inner) * _per_element(cfg, quantized)
    if remat == "quantized":
        return saved
    saved += tokens * (mamba.in_proj_width + m.d_model) * c
    saved += sum(scan_buffers(cfg, tokens).values())
    if remat == "none":
        saved += tokens * (3 * mamba.conv_dim * F32 + mamba.num_heads * F32)
        saved += tokens * (2 * mamba.inner * F32 + mamba.inner * c)
    return saved


def relu2_mlp_per_token(cfg, quantized: bool) -> float:
    """Bytes per token a relu2 MLP (`up`, `down`) keeps under `model.remat` (module doc)."""
    m, remat, c = cfg.model, cfg.model.remat, _compute_bytes(cfg)
    d, f = m.d_model, m.mlp_dim
    if remat == "full":
        return 0.0
    saved = (d + f) * _per_element(cfg, quantized)
    if remat in ("dots_no_batch", "dots", "none"):
        saved += (f + d) * c
    return saved + (2 * f * c if remat == "none" else 0)
