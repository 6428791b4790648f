"""The start-up checks of a run: which attention kernel and which GEMM backends it can trust
on this machine (`precision.attention_check`, `precision.backend_check`), and the `ops backend:`
line that says what runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from nvfp4_ops import get_recipe
from nvfp4_train.config.run_config import Config
from nvfp4_train.errors import ConfigError, RunError
from nvfp4_train.model.attention import attention_capability, run_attention, unfused_attention
from nvfp4_train.precision import attention_check
from nvfp4_train.precision.backend_check import backend_line, trusted_backend
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
    model = cfg.model
    chosen = run_attention(cfg, platform)
    ok, why = attention_capability(chosen, platform=platform, dtype=model.compute_dtype,
                                   head_dim=model.resolved_head_dim)  # fmt: skip
    if not ok:
        raise ConfigError(f"model.attention={model.attention!r} is not available here: {why}")
    return chosen


def _with_trusted_attention(cfg: Config, platform: str, say: Callable[[str], None]) -> Config:
    """`cfg`, or with `model.attention` replaced by what "auto" picks without fused kernels if
    the chosen kernel (`attention_check.CHECKED`) disagrees with "naive" here or crashes while
    checked (`precision.verify_backend`: "warn" continues, "strict" stops, "off" skips).

    Raises:
        RunError: under "strict", the kernel failed its check.
    """
    chosen, mode = _chosen_attention(cfg, platform), cfg.precision.verify_backend
    if chosen not in attention_check.CHECKED or mode == "off":
        return cfg
    m = cfg.model
    report = attention_check.verify_attention(
        chosen, dtype=m.compute_dtype, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.resolved_head_dim, max_documents=m.attention_max_documents,
    )  # fmt: skip
    say(f"attention check: {chosen} {report.summary()}")
    if report.ok:
        return cfg
    if mode == "strict":
        raise RunError(
            f"attention {chosen!r} failed its check against naive attention on this machine "
            f"({report.summary()}); precision.verify_backend=strict stops here"
        )
    fallback = unfused_attention(cfg.train.seq_len)
    say(f"WARNING: attention {chosen!r} is NOT used (it failed its check); this run uses "
        f"{fallback!r} (set model.attention to choose another)")  # fmt: skip
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=fallback))


def with_trusted_backend(cfg: Config, say: Callable[[str], None]) -> Config:
    """`cfg` with the backends that disagree with "emulated" here, or crash while checked, left
    out (`backend_check`); the `ops backend:` line (after the check) names them and why, and
    the attention implementation."""
    cfg = _with_trusted_attention(cfg, jax.default_backend(), say)
    attention = attention_text(cfg, jax.default_backend())
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
