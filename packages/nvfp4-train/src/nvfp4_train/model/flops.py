"""Model FLOPs of a training step and model FLOPs utilisation (MFU), counted in one place.

Training FLOPs per token (`train_flops_per_token`; every metrics row, benchmark and
`show-config` uses it):

    6 * N  +  6 * num_layers * num_heads * head_dim * seq_len

- N: the weights of every matrix multiplication, the output head included: per block the q, k, v
  and o projections `D * (H + 2G) * K + H * K * D` and the SwiGLU MLP `3 * D * F`, plus `D * V`
  for the head (tied or not). An MoE block counts the weights a token goes through (the active
  parameters): `3 * D * (k * F_e + S)` for its k routed experts and the shared ones (2 instead of
  3 with `expert_activation: relu2`; the routed experts' D is `latent_dim` with LatentMoE, whose
  projections add `2 * D * latent_dim`), and the router `D * E`. Multi-token prediction
  (`model.mtp`) adds, per depth, its blocks, `eh_proj` `2 * D * D` and the head `D * V`.
  Not the embedding lookup (a gather), norms or biases. 6 = 2 FLOPs
  per multiply-add x 3 GEMMs per weight (forward, Dgrad, Wgrad).
- Attention: QK^T and PV cost 2 * 2 * H * K FLOPs per query per key; a causal row attends to
  seq_len / 2 keys on average; backward is twice forward: 3 * 4 * H * K * seq_len / 2 per token
  and layer. As in MaxText and Megatron, the count is the model's, not the implementation's:
  document masks (which skip more) and recomputation (`model.remat`, `chunked`'s backward) do not
  change it.

- Hybrid models (`model.pattern`) count each block by its kind: an attention block its q, k, v, o
  weights and the attention term above; an MLP block `3 * D * F` (SwiGLU) or `2 * D * F` (relu2:
  up, down); an MoE block as above; a Mamba block its in_proj and out_proj weights
  `D * W + I * D` (W = in_proj width, I = d_inner = H * P) in N, plus (`mamba_flops_per_token`)
  3 x the forward of the depthwise conv and the chunked SSD (Mamba-2 paper, SSD algorithm, chunk
  Q, state N, G groups, H heads of width P; as computed, full Q x Q blocks):

      conv          2 * X * K                    (X = conv channels, K = conv_kernel)
      intra-chunk   2 * Q * (G * N + H * P)      (C B^T per group, then (decay * C B^T) (dt x))
      chunk states  2 * H * P * N                (B^T (dt x) per head)
      state passing 2 * H * P * N / Q            (one state update per chunk)
      output        2 * H * P * N                (C h per head)

`model_tflops_per_device` = train FLOPs per token x tokens/s / devices / 1e12. MFU divides it by
the device's dense (no sparsity) peak: `PEAKS`, per GPU, from NVIDIA's datasheets; `mfu` against
the BF16 peak (the usual convention), `mfu_fp4` against the FP4 peak for runs that quantize
(an upper bound on what FP4 GEMMs could reach: attention, norms and BF16 layers do not run in FP4).
A device not in the table (CPU, TPU, other GPUs) gets no MFU.

Example:
    >>> from nvfp4_train.model.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                   mlp_dim=128, max_seq_len=32)
    >>> matmul_params(cfg), train_flops_per_token(cfg, seq_len=32)
    (90112, 565248)
    >>> device_peak("NVIDIA B200")
    Peak(name='B200', bf16_tflops=2250.0, fp4_tflops=9000.0)
"""

import dataclasses

from nvfp4_train.model.config import block_kinds, is_moe_block


@dataclasses.dataclass(frozen=True)
class Peak:
    """Dense tensor-core peaks of one GPU, in TFLOP/s (None: no FP4 tensor cores)."""

    name: str
    bf16_tflops: float
    fp4_tflops: float | None


PEAKS = (
    # (substring of jax's device_kind, peak). The first match wins: specific names first.
    # GB200 NVL72 and HGX B200 datasheets (per GPU, "with sparsity" halved): GB200 FP4 20 PF,
    # BF16 5 PF; HGX B200 FP4 18 PF, BF16 4.5 PF.
    ("GB200", Peak("GB200", 2500.0, 10000.0)),
    ("B200", Peak("B200", 2250.0, 9000.0)),
    # H100 / H200 datasheets (BF16 with sparsity: SXM 1,979, NVL 1,671, PCIe 1,513 TFLOPS).
    ("H100 PCIe", Peak("H100 PCIe", 756.5, None)),
    ("H100 NVL", Peak("H100 NVL", 835.5, None)),
    ("H200 NVL", Peak("H200 NVL", 835.5, None)),
    ("H100", Peak("H100 SXM", 989.5, None)),
    ("H200", Peak("H200 SXM", 989.5, None)),
)
"""Devices whose dense peaks are known; see the module docstring for the sources."""


def device_peak(device_kind: str) -> Peak | None:
    """The peak of a device (`jax.devices()[0].device_kind`), or None when not in `PEAKS`."""
    for pattern, peak in PEAKS:
        if pattern in device_kind:
            return peak
    return None


def matmul_params(cfg) -> int:
    """N: the weights of the model's matrix multiplications a token goes through (`ModelConfig`,
    vocab_size set): in an MoE block its `experts_per_token` routed experts, the shared experts
    and the router (the active parameters), not every expert; a hybrid model's blocks by kind;
    each MTP depth's blocks, `eh_proj` and the output head again."""
    main = sum(_block_params(cfg, kind, is_moe_block(cfg, i)) for i, kind in
               enumerate(block_kinds(cfg)))  # fmt: skip
    return main + cfg.d_model * cfg.vocab_size + _mtp_params(cfg)


def _mtp_params(cfg) -> int:
    """The matmul weights a token goes through in the MTP layers, every depth (`model.mtp`)."""
    mtp = cfg.mtp
    if not mtp.num_layers:
        return 0
    blocks = sum(_block_params(cfg, kind, kind == "moe") for kind in mtp.kinds)
    d = cfg.d_model
    return mtp.resolved_depths * (blocks + 2 * d * d + d * cfg.vocab_size)


def _moe_params(cfg) -> int:
    """The matmul weights a token goes through in an MoE MLP: its k routed experts and shared
    experts (3 matrices each with SwiGLU, 2 with relu2), the router, LatentMoE's projections."""
    d, moe = cfg.d_model, cfg.moe
    width = moe.latent_dim or d
    matrices = 3 if moe.expert_activation == "swiglu" else 2
    routed = matrices * width * moe.experts_per_token * moe.expert_mlp_dim
    shared = matrices * d * moe.shared_mlp_dim + d * moe.shared_expert_gate
    return routed + shared + d * moe.num_experts + 2 * d * moe.latent_dim


def _block_params(cfg, kind: str, moe: bool) -> int:
    """The matmul weights a token goes through in a block of kind `kind` (`moe`: its MLP is the
    MoE MLP)."""
    d, k = cfg.d_model, cfg.resolved_head_dim
    attention = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * k + cfg.num_heads * k * d
    if kind == "mamba":
        return d * cfg.mamba.in_proj_width + cfg.mamba.inner * d
    if kind == "attention":
        return attention
    if moe:
        return _moe_params(cfg) + (attention if kind == "llama" else 0)
    dense = (2 if kind == "mlp" and cfg.mlp_activation == "relu2" else 3) * d * cfg.mlp_dim
    return dense + (attention if kind == "llama" else 0)


def mamba_flops_per_token(cfg) -> float:
    """Forward FLOPs per token of one Mamba block beyond its in_proj / out_proj GEMMs: the conv
    and the chunked SSD (module docstring)."""
    m = cfg.mamba
    h, p, n, g, q = m.num_heads, m.head_dim, m.state_dim, m.n_groups, m.chunk_size
    conv = 2 * m.conv_dim * m.conv_kernel
    return conv + 2 * q * (g * n + h * p) + 4 * h * p * n + 2 * h * p * n / q


def train_flops_per_token(cfg, *, seq_len: int) -> int:
    """FLOPs of one training step per token (forward and backward), see the module docstring."""
    kinds = block_kinds(cfg)
    mtp = cfg.mtp.kinds * cfg.mtp.resolved_depths if cfg.mtp.num_layers else ()
    attention_blocks = sum(kind in ("llama", "attention") for kind in (*kinds, *mtp))
    attention = 6 * attention_blocks * cfg.num_heads * cfg.resolved_head_dim * seq_len
    mamba = 3 * kinds.count("mamba") * mamba_flops_per_token(cfg) if "mamba" in kinds else 0
    return int(6 * matmul_params(cfg) + attention + mamba)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What a run needs to turn tokens/s into model TFLOP/s per device and MFU."""

    flops_per_token: int
    devices: int
    peak: Peak | None
    quantized: bool

    def fields(self, tokens_per_s: float) -> dict[str, float]:
        """`model_tflops_per_device`, and `mfu` / `mfu_fp4` where the peak is known."""
        tflops = self.flops_per_token * tokens_per_s / self.devices / 1e12
        row = {"model_tflops_per_device": tflops}
        if self.peak is not None:
            row["mfu"] = tflops / self.peak.bf16_tflops
            if self.quantized and self.peak.fp4_tflops is not None:
                row["mfu_fp4"] = tflops / self.peak.fp4_tflops
        return row
