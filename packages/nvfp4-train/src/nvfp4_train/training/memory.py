"""What a config needs per device, before any device is rented: `estimate_memory`.

Parameters, optimizer state and gradients are counted exactly from the model's shapes and the
sharding rules (`sharding.tree_shardings` on the mesh the config resolves to for `devices`).
Activations are an analytic estimate per token of the microbatch one device runs
(`batch_size / grad_accum_steps / (data x fsdp)` sequences), by `model.remat`:

    full           the block inputs:                            d*c
    quantized      + the FP4 operands of the quantized linears:  (2d + q + f) * 9/16
    dots_no_batch  + the outputs of the linears:                 (q + 2kv + 2d + 2f) * c
                   + fused attention's output and statistics:    q*c + H*4     (fused only)
    dots           + the attention matmuls' outputs:             q*c + H*L*4   (unfused only)
    none           + softmax, RoPE, SwiGLU intermediates:        H*L*(4 + c) + (q + kv + 3f + 2d) * c
                                                                 (fused: no H*L*(4 + c); cudnn
                                                                 with a dense mask: + L*c)

per block (d = d_model, q = heads x head_dim, kv = kv_heads x head_dim, f = mlp_dim, H = heads,
L = seq_len, c = bytes of the compute dtype; 9/16 byte per element is an E2M1 code plus its share
of an E4M3 block scale). An MoE block's MLP keeps its routed experts' rows instead (k per token,
or with `mesh.expert` > 1 every row its experts could take of the whole batch) and the dispatch
buffers: `moe_memory`; its experts' parameters, gradients and optimizer state are split over
`expert` by the sharding rules. One MoE block's routed experts at a time also hold the dispatch
buffers, the grouped GEMMs' decoded operands and the float32 combine buffer
(`moe_memory.routed_buffers`, named in the printed breakdown): a transient like the logits. A
BF16 block's linears keep their inputs in the compute dtype without remat and recompute them
with it. With several precision phases (`precision.bf16_forward_from`,
`precision.schedule`) a block counts as quantized in a phase when its `mlp.down` (MoE: `mlp.experts.down`) linear's
recipe of that phase quantizes, and the estimate is the phase that keeps the most.

Attention (`model.attention`, resolved as on an NVIDIA GPU unless another implementation is asked
for) decides the L-dependent terms: `naive` and `xla` materialise the scores, so the rows above
keep H*L floats per token and one block's scores and probabilities ([H, L, L] in float32 and the
compute dtype per sequence) exist at a time; fused attention (`cudnn`, and `chunked`, which is
fused in JAX) keeps the float32 log-sum-exp of each row instead (under the dots policies too:
`attention.SAVES_ATTENTION`), and holds one [block x block] tile per head (`chunked`) or nothing
beyond the kernel's workspace (`te`, `cudnn`). Except `cudnn` with document masks on jax <= 0.10.2
(`attention.cudnn_mask_is_dense`, assumed unless `data.document_mask` is false): jax hands cuDNN
the mask as a dense [B, 1, L, L] bias in the compute dtype, keeps it for the backward without
remat (L*c per token), and the backward writes its [B, 1, L, L] gradient, so one block holds the
boolean mask, the bias and its gradient, L*L*(1 + 2c) per sequence. The largest transient is
that, the float32 logits and their gradient, or an MoE block's routed-expert buffers, whichever
is largest.
A hybrid model (`model.pattern`) counts each block by its kind (`mamba_memory`: Mamba blocks with
the chunked scan's buffers, named in the printed breakdown; attention blocks as the attention
rows above; MLP blocks, relu2 or SwiGLU; MoE blocks as `moe_memory`).
XLA's fusion and buffer reuse move the real figure either way (expect +-50%);
`benchmarks/bench_compile.py` reports what the compiled step allocates.

Example:
    >>> from nvfp4_train.config.run_config import load_config
    >>> estimate = estimate_memory(load_config("examples/configs/llama3-8b-blackwell.yaml"), 8)
    >>> print(format_estimate(estimate))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh.sharding import AXES, BATCH_AXES, check_expert_split, tree_shardings
from nvfp4_train.model.blocks.attention import cudnn_mask_is_dense, run_attention
from nvfp4_train.model.config import block_kinds, block_linear_names, is_moe_block
from nvfp4_train.model.structure import moe_linear_names
from nvfp4_train.precision.policy import precision_phases
from nvfp4_train.training.mamba_memory import mamba_block_bytes, relu2_mlp_per_token, scan_buffers
from nvfp4_train.training.moe_memory import (
    dense_mlp_per_token,
    mlp_correction,
    moe_mlp_bytes,
    routed_buffers,
)
from nvfp4_train.training.resume import abstract_state

FP4_BYTES = 9 / 16
"""Bytes per element of an NVFP4 operand: a 4-bit code and 1/16 of an 8-bit block scale."""
GIB = 2**30
FUSED = ("cudnn", "te", "chunked")
"""Implementations that never hold an [L, L] score matrix (`xla` and `naive` do)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds (see the module doc for what is exact and what is estimated)."""

    devices: int
    mesh: dict[str, int]
    sequences: int
    seq_len: int
    remat: str
    attention: str
    peak_phase: str
    parameters: int
    optimizer: int
    gradients: int
    activations: int
    transient: int
    dense_mask: bool = False
    """`cudnn` holds a dense [L, L] document mask (see the module doc)."""
    scan_buffers: tuple[tuple[str, int], ...] = ()
    """A hybrid model's Mamba blocks: the chunked scan's buffers over all of them, part of
    `activations` (`mamba_memory.scan_buffers`)."""
    moe_buffers: tuple[tuple[str, int], ...] = ()
    """One MoE block's routed-expert buffers (`moe_memory.routed_buffers`; empty without MoE);
    `transient` when their sum is the largest transient."""

    @property
    def moe_transient(self) -> int:
        return sum(value for _, value in self.moe_buffers)

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.gradients + self.activations + self.transient


def _sharded_bytes(tree, params, mesh: AbstractMesh) -> int:
    """Bytes per device of `tree`'s leaves placed as a run places them (`tree_shardings`)."""
    shardings = jax.tree.leaves(tree_shardings(tree, params, mesh))
    return sum(
        math.prod(sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        for leaf, sharding in zip(jax.tree.leaves(tree), shardings, strict=True)
    )


def _saved_per_token(cfg, quantized: bool, attention: str) -> float:
    """Bytes per token one block keeps for the backward pass under `cfg.model.remat`, with the
    attention implementation `attention`."""
    m = cfg.model
    c = jnp.dtype(m.compute_dtype).itemsize
    d, f, heads, length = m.d_model, m.mlp_dim, m.num_heads, cfg.train.seq_len
    q, kv = heads * m.resolved_head_dim, m.num_kv_heads * m.resolved_head_dim
    # a quantized linear saves its FP4 operands (named residuals) under every policy but
    # "full"; a BF16 linear's input is the output of elementwise work, saved only without remat
    per_element = FP4_BYTES if quantized else (c if m.remat == "none" else 0)
    operands = (2 * d + q + f) * per_element
    saved = d * c
    if m.remat == "full":
        return saved
    saved += operands
    if m.remat == "quantized":
        return saved
    saved += (q + 2 * kv + 2 * d + 2 * f) * c
    fused = attention in FUSED
    if fused:  # its output and float32 statistics (`attention.SAVES_ATTENTION`), no scores
        saved += q * c + heads * 4
    if m.remat == "dots_no_batch":
        return saved
    if not fused:  # QK^T (float32) and PV have batch dimensions: only "dots" keeps them
        saved += q * c + heads * length * 4
    if m.remat == "dots":
        return saved
    probabilities = 0 if fused else heads * length * (4 + c)
    dense_mask = length * c if _dense_cudnn_mask(cfg, attention) else 0
    return saved + probabilities + dense_mask + (q + kv + 3 * f + 2 * d) * c


def _dense_cudnn_mask(cfg, attention: str) -> bool:
    """Whether `attention` holds an [L, L] document mask per sequence (`cudnn` with masks on a jax
    that turns them into a dense bias)."""
    masked = cfg.data.document_mask is not False
    return attention == "cudnn" and masked and cudnn_mask_is_dense()


def gpu_attention(cfg) -> str:
    """The implementation `model.attention` stands for in a run of `cfg` on NVIDIA GPUs."""
    return run_attention(cfg, "gpu")


def _attention_transient(cfg, sequences: int, attention: str) -> int:
    """Bytes of the attention intermediates one block holds at a time (see the module doc)."""
    m, length = cfg.model, cfg.train.seq_len
    c = jnp.dtype(m.compute_dtype).itemsize
    if _dense_cudnn_mask(cfg, attention):  # the boolean mask, the bias and its gradient
        return sequences * length * length * (1 + 2 * c)
    if attention in ("cudnn", "te"):
        return 0
    side = min(m.attention_block, length) if attention == "chunked" else length  # tile or [L, L]
    return sequences * m.num_heads * side * side * (4 + c)


def estimate_memory(cfg, devices: int, attention: str | None = None) -> MemoryEstimate:
    """Per-device bytes of a run of `cfg` on `devices` devices (`mesh` resolved for them), with
    the attention implementation `attention` (default: `gpu_attention(cfg)`).

    Raises:
        ConfigError: `model.vocab_size` is 0 (taken from the data: set it to estimate), or the
            mesh does not fit `devices`.
    """
    if cfg.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size is 0 (taken from the data): set it to estimate memory")
    try:
        sizes = dict(zip(AXES, cfg.mesh.resolve(devices), strict=True))
    except ConfigError as err:
        raise ConfigError(f"mesh for {devices} devices: {err}") from None
    check_expert_split(cfg.model.moe.num_experts, sizes["expert"])
    mesh = AbstractMesh(tuple(sizes.values()), AXES)
    _, state = abstract_state(cfg)
    params = _sharded_bytes(state.params, state.params, mesh)
    optimizer = _sharded_bytes(state.opt_state, state.params, mesh)
    attention = gpu_attention(cfg) if attention is None else attention
    empty = MemoryEstimate(
        devices=devices, mesh=sizes, sequences=0, seq_len=cfg.train.seq_len,
        remat=cfg.model.remat, attention=attention, peak_phase="", parameters=params,
        optimizer=optimizer, gradients=params, activations=0, transient=0,
    )  # fmt: skip
    return with_activations(empty, cfg)


def with_activations(estimate: MemoryEstimate, cfg) -> MemoryEstimate:
    """`estimate` (its mesh, attention and state bytes) with the activations and transient of
    `cfg` (its batch, `model.remat` and precision phases; the model's shapes unchanged)."""
    sizes, attention = estimate.mesh, estimate.attention
    batch_split = math.prod(sizes[a] for a in BATCH_AXES)
    micro = cfg.train.batch_size // cfg.train.grad_accum_steps
    sequences = max(micro // batch_split, 1) if micro % batch_split == 0 else micro
    tokens = sequences * cfg.train.seq_len
    phases = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
    down = [_down_path(cfg.model, i) for i in range(cfg.model.num_layers)]
    quantized = [[phase.recipes[path].quantized for path in down] for phase in phases]
    saved = {
        phase.label: sum(
            _block_bytes(cfg, i, q, attention, sizes, tokens) for i, q in enumerate(blocks)
        )
        for phase, blocks in zip(phases, quantized, strict=True)
    }
    peak = max(saved, key=saved.get)
    logits = 2 * tokens * cfg.model.vocab_size * 4 // sizes["tensor"]
    moe = tuple((k, int(v)) for k, v in _largest_routed_buffers(cfg, phases, sizes, tokens).items())
    routed = sum(v for _, v in moe)
    return dataclasses.replace(
        estimate, sequences=sequences, seq_len=cfg.train.seq_len, remat=cfg.model.remat,
        peak_phase=peak if len(phases) > 1 else "", activations=int(saved[peak]),
        transient=max(_attention_transient(cfg, sequences, attention), logits, routed),
        dense_mask=_dense_cudnn_mask(cfg, attention), scan_buffers=_scan_total(cfg, tokens),
        moe_buffers=moe,
    )  # fmt: skip


def _largest_routed_buffers(cfg, phases, sizes, tokens: int) -> dict[str, float]:
    """`moe_memory.routed_buffers` of the MoE block and precision phase whose sum is largest
    (empty without MoE blocks)."""
    names = moe_linear_names(cfg.model.moe)[:2]  # the experts' first linear and down
    recipes = {
        tuple(phase.recipes[f"layers.{i}.{name}"] for name in names)
        for phase in phases
        for i in range(cfg.model.num_layers)
        if is_moe_block(cfg.model, i)
    }
    candidates = [routed_buffers(cfg, pair, sizes, tokens) for pair in recipes]
    return max(candidates, key=lambda b: sum(b.values()), default={})


def _down_path(model, index: int) -> str:
    """The linear whose recipe says whether block `index` counts as quantized: its MLP's `down`
    (MoE: `mlp.experts.down`), or a Mamba / attention block's last linear."""
    names = block_linear_names(model, index)
    return f"layers.{index}." + ("mlp.experts.down" if "mlp.experts.down" in names else names[-1])


def _block_bytes(cfg, index: int, quantized: bool, attention: str, sizes, tokens: int) -> float:
    """Bytes block `index` keeps for the backward (a Llama-style block: the module doc's rows;
    a hybrid block: its input and its mixer's, `mamba_memory`)."""
    kind, m = block_kinds(cfg.model)[index], cfg.model
    if kind == "llama":
        per_token = _saved_per_token(cfg, quantized, attention)
        return tokens * per_token + mlp_correction(cfg, index, quantized, sizes, tokens)
    block_input = tokens * m.d_model * jnp.dtype(m.compute_dtype).itemsize
    if kind == "mamba":
        return block_input + mamba_block_bytes(cfg, quantized, tokens)
    if kind == "moe":
        return block_input + moe_mlp_bytes(cfg, quantized, sizes, tokens)
    if kind == "mlp":
        relu2 = m.mlp_activation == "relu2"
        mlp = relu2_mlp_per_token if relu2 else dense_mlp_per_token
        return block_input + tokens * mlp(cfg, quantized)
    both = _saved_per_token(cfg, quantized, attention)  # attention: a Llama block less its MLP
    return tokens * (both - dense_mlp_per_token(cfg, quantized))


def _scan_total(cfg, tokens: int) -> tuple[tuple[str, int], ...]:
    """(buffer, bytes over every Mamba block) of the chunked scans (empty without Mamba)."""
    blocks = block_kinds(cfg.model).count("mamba")
    if not blocks:
        return ()
    return tuple((k, int(v * blocks)) for k, v in scan_buffers(cfg, tokens).items())


_TRANSIENT = {
    "naive": "one block's attention scores",
    "xla": "one block's attention scores",
    "cudnn": "fused attention's workspace",
    "te": "fused attention's workspace",
    "chunked": "one attention tile per head",
}


def _transient_name(estimate: MemoryEstimate) -> str:
    if estimate.moe_buffers and estimate.moe_transient == estimate.transient:
        return "one MoE block's routed experts (below)"
    if estimate.attention == "cudnn" and estimate.dense_mask:
        return "cudnn's dense document mask and its gradient or the logits"
    return _TRANSIENT[estimate.attention] + " or the logits"


def _moe_lines(estimate: MemoryEstimate) -> list[str]:
    """The routed-expert buffers' rows under the transient (none without MoE)."""
    if not estimate.moe_buffers:
        return []
    largest = estimate.moe_transient == estimate.transient
    head = "of which" if largest else "less than the largest transient:"
    lines = [f"#     {head} one MoE block's routed experts (all counted live at once):"]
    return lines + [f"#       {k:<62} {v / GIB:9.2f} GiB" for k, v in estimate.moe_buffers]


def format_estimate(estimate: MemoryEstimate) -> str:
    """The estimate as YAML comment lines (so `show-config --memory` output stays YAML)."""
    mesh = " ".join(f"{k}={v}" for k, v in estimate.mesh.items())
    phase = f", steps {estimate.peak_phase}" if estimate.peak_phase else ""
    rows = [
        ("parameters (float32)", estimate.parameters),
        ("optimizer state", estimate.optimizer),
        ("gradients (float32)", estimate.gradients),
        (f"activations kept for backward (remat: {estimate.remat}{phase}, estimate)",
         estimate.activations),
        (f"largest transient: {_transient_name(estimate)}", estimate.transient),
    ]  # fmt: skip
    lines = [
        f"# memory per device on {estimate.devices} devices (mesh {mesh}; "
        f"{estimate.sequences} sequences x {estimate.seq_len} tokens per device and microbatch; "
        f"attention: {estimate.attention}):"
    ]
    lines += [f"#   {name:<66} {value / GIB:9.2f} GiB" for name, value in rows[:4]]
    if estimate.scan_buffers:
        lines.append("#     of which the Mamba blocks' chunked SSD scans:")
    lines += [f"#       {name:<62} {value / GIB:9.2f} GiB" for name, value in estimate.scan_buffers]
    lines += [f"#   {name:<66} {value / GIB:9.2f} GiB" for name, value in rows[4:]]
    lines += _moe_lines(estimate)
    lines.append(f"#   {'total':<66} {estimate.total / GIB:9.2f} GiB")
    return "\n".join(lines) + "\n"


def format_attention_choices(estimate: MemoryEstimate, cfg) -> str:
    """YAML comment lines: the total per device (`estimate`'s mesh and state) with each attention
    implementation and remat policy, for choosing them (`show-config --memory`)."""
    policies = ("none", "dots", "quantized", "full")
    lines = ["# total per device by model.attention (rows) and model.remat (columns), GiB:"]
    lines.append("#   " + " " * 10 + "".join(f"{p:>12}" for p in policies))
    for attention in ("naive", "cudnn", "chunked"):
        totals = []
        for remat in policies:
            variant = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat))
            choice = dataclasses.replace(estimate, attention=attention)
            totals.append(with_activations(choice, variant).total / GIB)
        lines.append("#   " + f"{attention:<10}" + "".join(f"{t:12.1f}" for t in totals))
    return "\n".join(lines) + "\n"
