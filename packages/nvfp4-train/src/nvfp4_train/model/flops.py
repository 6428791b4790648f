"""Model FLOPs of a training step and model FLOPs utilisation (MFU), counted in one place.

Training FLOPs per token (`train_flops_per_token`; every metrics row, benchmark and
`show-config` uses it):

    6 * N  +  6 * num_layers * num_heads * head_dim * seq_len

- N: the weights of every matrix multiplication, the output head included: per block the q, k, v
  and o projections `D * (H + 2G) * K + H * K * D` and the SwiGLU MLP `3 * D * F`, plus `D * V`
  for the head (tied or not). An MoE block counts the weights a token goes through (the active
  parameters): `3 * D * (k * F_e + S)` for its k routed experts and the shared ones, and the
  router `D * E`. Not the embedding lookup (a gather), norms or biases. 6 = 2 FLOPs
  per multiply-add x 3 GEMMs per weight (forward, Dgrad, Wgrad).
- Attention: QK^T and PV cost 2 * 2 * H * K FLOPs per query per key; a causal row attends to
  seq_len / 2 keys on average; backward is twice forward: 3 * 4 * H * K * seq_len / 2 per token
  and layer. As in MaxText and Megatron, the count is the model's, not the implementation's:
  document masks (which skip more) and recomputation (`model.remat`, `chunked`'s backward) do not
  change it.

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

from nvfp4_train.model.config import moe_layers


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
    and the router (the active parameters), not every expert."""
    d, k = cfg.d_model, cfg.resolved_head_dim
    attention = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * k + cfg.num_heads * k * d
    moe, moe_blocks = cfg.moe, len(moe_layers(cfg))
    routed = moe.experts_per_token * moe.expert_mlp_dim + moe.shared_mlp_dim
    mlp = (cfg.num_layers - moe_blocks) * 3 * d * cfg.mlp_dim
    mlp += moe_blocks * (3 * d * routed + d * moe.num_experts + d * moe.shared_expert_gate)
    return cfg.num_layers * attention + mlp + d * cfg.vocab_size


def train_flops_per_token(cfg, *, seq_len: int) -> int:
    """FLOPs of one training step per token (forward and backward), see the module docstring."""
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len
    return 6 * matmul_params(cfg) + attention


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
