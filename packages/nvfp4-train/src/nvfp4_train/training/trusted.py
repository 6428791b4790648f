"""The start-up checks of a run: which attention kernel and which GEMM backends it can trust
on this machine (`precision.attention_check`, `precision.backend_check`), the document bound
attention "te" is compiled for, and the `ops backend:` line that says what runs."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from nvfp4_ops import get_recipe
from nvfp4_train.config.run_config import Config
from nvfp4_train.errors import ConfigError, RunError
from nvfp4_train.mesh.sharding import BATCH_AXES, activation_constraint
from nvfp4_train.model.blocks.attention import (
    FUSED_KERNELS,
    attention_capability,
    fused_kernels,
    run_attention,
    run_shape,
    unfused_attention,
)
from nvfp4_train.precision import attention_check
from nvfp4_train.precision.backend_check import backend_line, te_context, trusted_backend
from nvfp4_train.precision.policy import precision_phases


def attention_text(cfg: Config, platform: str) -> str:
    """`model.attention=<configured> -> <what runs at train.seq_len here>`.

    Raises:
        ConfigError: the configured implementation cannot run on `platform` (one line).
    """
    model = cfg.model
    chosen = _chosen_attention(cfg, platform)
    block = f" (attention_block={model.attention_block})" if chosen == "chunked" else ""
    return f"model.attention={model.attention} -> {chosen}{block}"


def _chosen_attention(cfg: Config, platform: str) -> str:
    """The implementation `model.attention` stands for at `train.seq_len` on `platform`.

    Raises:
        ConfigError: it cannot run there (one line).
    """
    shape = run_shape(cfg, platform)
    chosen = run_attention(cfg, platform)
    ok, why = attention_capability(chosen, **{k: shape[k] for k in _CAPABILITY_KEYS})
    if not ok:
        raise ConfigError(f"model.attention={cfg.model.attention!r} is not available here: {why}")
    return chosen


_CAPABILITY_KEYS = ("platform", "dtype", "head_dim", "num_heads", "num_kv_heads", "gpu")


def _candidates(cfg: Config, platform: str) -> list[str]:
    """The kernel the run would use, then the fused kernels after it that run here (a kernel
    that fails its check gives way to the next, before the unfused ones)."""
    chosen = _chosen_attention(cfg, platform)
    if chosen not in FUSED_KERNELS:
        return [chosen]
    after = FUSED_KERNELS[FUSED_KERNELS.index(chosen) + 1 :]
    return [chosen, *(k for k in fused_kernels(**run_shape(cfg, platform)) if k in after)]


def _check(cfg: Config, implementation: str, mesh: Any) -> attention_check.AttentionReport:
    """`verify_attention` of `implementation` as a run of `cfg` computes it: its length, bound,
    heads and remat policy, over `mesh` (two rows per batch shard) when one is given."""
    m = cfg.model
    shape = {
        "dtype": m.compute_dtype, "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
        "head_dim": m.resolved_head_dim, "seq_len": cfg.train.seq_len,
        "max_documents": m.attention_max_documents, "remat": m.remat,
    }  # fmt: skip
    if mesh is None:
        return attention_check.verify_attention(implementation, **shape)
    rows = 2 * math.prod(mesh.shape[a] for a in BATCH_AXES)
    context = te_context(cfg.precision.backend, mesh, data="data", fsdp="fsdp",
                         attention=implementation)  # fmt: skip
    with context:
        return attention_check.verify_attention(
            implementation, rows=rows, constrain=activation_constraint(mesh), **shape
        )


def _with_trusted_attention(
    cfg: Config, platform: str, say: Callable[[str], None], mesh: Any = None
) -> Config:
    """`cfg`, or with `model.attention` replaced by the first kernel that passes its check
    (`attention_check.CHECKED` kernels are checked, in `_candidates` order), else by what "auto"
    picks without fused kernels (`precision.verify_backend`: "warn" continues, "strict" stops,
    "off" skips).

    Raises:
        RunError: under "strict", the kernel failed its check.
    """
    candidates, mode = _candidates(cfg, platform), cfg.precision.verify_backend
    if candidates[0] not in attention_check.CHECKED or mode == "off":
        return cfg
    for position, name in enumerate(candidates):
        report = _check(cfg, name, mesh)
        say(f"attention check: {name} {report.summary()}")
        if report.ok:
            return cfg if position == 0 else _with_attention(cfg, name)
        if mode == "strict":
            raise RunError(
                f"attention {name!r} failed its check against {report.reference} attention on "
                f"this machine ({report.summary()}); precision.verify_backend=strict stops here"
            )
        if position + 1 < len(candidates):
            say(f"WARNING: attention {name!r} is NOT used (it failed its check); checking "
                f"{candidates[position + 1]!r} next")  # fmt: skip
    fallback = unfused_attention(cfg.train.seq_len)
    say(f"WARNING: attention {candidates[-1]!r} is NOT used (it failed its check); this run uses "
        f"{fallback!r} (set model.attention to choose another)")  # fmt: skip
    return _with_attention(cfg, fallback)


def _with_attention(cfg: Config, implementation: str) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=implementation))


def with_document_bound(cfg: Config, datasets: Any, say: Callable[[str], None]) -> Config:
    """`cfg` with `model.attention_max_documents: 0` replaced by the most documents a row of the
    data holds (`datasets.max_documents_per_row()`, 1 without documents) when the run's attention
    is "te" here (cuDNN then gets that many sequence slots per row, not one per token); `cfg`
    unchanged otherwise. The run directory's config keeps 0."""
    if cfg.model.attention_max_documents or run_attention(cfg, jax.default_backend()) != "te":
        return cfg
    counted = datasets.max_documents_per_row()
    bound = counted or 1
    say(f"attention te: compiled for {bound} document(s) per row, the most a row of the data "
        "holds (model.attention_max_documents=0; a smaller bound compiles faster and uses less "
        "memory)")  # fmt: skip
    model = dataclasses.replace(cfg.model, attention_max_documents=bound)
    return dataclasses.replace(cfg, model=model)


def with_trusted_backend(cfg: Config, say: Callable[[str], None], mesh: Any = None) -> Config:
    """`cfg` with the attention kernel and GEMM backends that disagree with their references
    here, or crash while checked, left out (`attention_check`, `backend_check`; the attention
    kernel is checked over `mesh`, the run's, when given), and `model.attention` resolved to the
    implementation that runs; the `ops backend:` line (after the checks) names them and why, and
    the attention implementation."""
    cfg = _with_trusted_attention(cfg, jax.default_backend(), say, mesh)
    attention = attention_text(cfg, jax.default_backend())
    # what was checked is what runs: the model resolves "auto" from its own inputs, which may
    # differ from the run's (`run_shape` counts data.document_mask: auto as masked)
    cfg = _with_attention(cfg, run_attention(cfg, jax.default_backend()))
    phases = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
    names = {n for phase in phases for gemms in phase.names.values() for n in gemms}
    choice = trusted_backend(cfg.precision, names, say)
    if any(get_recipe(n).quantized for n in names):
        say(f"{backend_line(cfg.precision.backend, choice.dropped)}; {attention}")
    else:
        say(f"ops backend: {attention}")
    if choice.backend == cfg.precision.backend:
        return cfg
    precision = dataclasses.replace(cfg.precision, backend=choice.backend)
    return dataclasses.replace(cfg, precision=precision)


def run_context(cfg: Config, mesh: Any) -> contextlib.AbstractContextManager:
    """What a run's steps are traced and compiled in: TE's mesh context when the run may call TE
    on several devices (`backend_check.te_context`, attention resolved as the run uses it)."""
    attention = run_attention(cfg, jax.default_backend())
    return te_context(cfg.precision.backend, mesh, data="data", fsdp="fsdp", attention=attention)
