"""`train.deterministic`: XLA's deterministic GPU ops, asked for before JAX starts its backend.

On a GPU, the backward pass of the embedding lookup and of the MoE dispatch's token gathers is a
scatter-add with repeated indices, which XLA sums in a run-dependent order unless
`--xla_gpu_deterministic_ops=true` is in `XLA_FLAGS` (XLA's own description of the flag:
"Guarantees run-to-run determinism on GPU"; it also makes XLA's GPU autotuner take the first
kernel that works instead of the fastest: docs/distributed.md quotes the sources on the cost).
XLA reads `XLA_FLAGS` once, when JAX initialises its backend, so the CLI (`nvfp4-train run`)
applies the setting before anything touches a device: `apply_to_environment`.

`train.deterministic`: true, false, or "auto" (the default): on when the run saves checkpoints
before its last step (`checkpoint.every_steps` in (0, train.steps)), i.e. when it promises that a
run killed between them resumes with bit-identical losses (docs/distributed.md); off for a run
that checkpoints only at its end. XLA:CPU's scatters are deterministic either way: the flag is
appended only where JAX may start a GPU backend (a CUDA or ROCm PJRT plugin installed, found as
JAX finds them, and `JAX_PLATFORMS` not ruling GPUs out); it would be inert on a CPU backend.

Example:
    >>> with_flag("--xla_force_host_platform_device_count=8")
    '--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true'
    >>> flag_value("--xla_gpu_deterministic_ops=false --xla_gpu_deterministic_ops")
    'true'
"""

from __future__ import annotations

import importlib.metadata
import pkgutil
from collections.abc import MutableMapping

FLAG_NAME = "xla_gpu_deterministic_ops"
FLAG = f"--{FLAG_NAME}=true"
GPU_PLATFORMS = ("cuda", "rocm", "gpu")
"""`JAX_PLATFORMS` entries that name a GPU backend (and words in a GPU plugin's name)."""


def wants_determinism(cfg) -> bool:
    """Whether the run `cfg` asks for deterministic GPU ops (`train.deterministic`, "auto"
    resolved: on when it saves a checkpoint before its last step)."""
    setting = cfg.train.deterministic
    if setting != "auto":
        return bool(setting)
    return 0 < cfg.checkpoint.every_steps < cfg.train.steps


def flag_value(xla_flags: str) -> str | None:
    """The value `xla_flags` gives `FLAG_NAME` (its last occurrence wins, as in XLA; a bare flag
    is "true"), or None when it does not name it."""
    value = None
    for token in xla_flags.split():
        name, _, given = token.lstrip("-").partition("=")
        if name == FLAG_NAME:
            value = given or "true"
    return value


def with_flag(xla_flags: str) -> str:
    """`xla_flags` with `FLAG` appended, the flags already there kept (unchanged when they name
    `FLAG_NAME` already: an explicit value wins)."""
    if flag_value(xla_flags) is not None:
        return xla_flags
    return f"{xla_flags.strip()} {FLAG}".strip()


def gpu_plugins() -> list[str]:
    """The installed PJRT plugins for GPUs, found as JAX discovers plugins (modules of the
    `jax_plugins` namespace package and `jax_plugins` entry points), without importing them."""
    names = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins
    except ImportError:
        jax_plugins = None
    if jax_plugins is not None:
        names += [module.name for module in pkgutil.iter_modules(jax_plugins.__path__)]
    return [n for n in names if any(word in n.lower() for word in GPU_PLATFORMS)]


def may_use_gpu(platforms: str) -> bool:
    """Whether JAX may start a GPU backend: a GPU plugin is installed (`gpu_plugins`) and
    `JAX_PLATFORMS=platforms` ("": any) names a GPU platform or none."""
    names = [p.strip().lower() for p in platforms.split(",") if p.strip()]
    allowed = not names or any(p in GPU_PLATFORMS for p in names)
    return allowed and bool(gpu_plugins())


def backend_started() -> bool:
    """Whether JAX has initialised its backends already (too late for `XLA_FLAGS`)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())


def apply_to_environment(cfg, env: MutableMapping[str, str]) -> str | None:
    """Appends `FLAG` to `env["XLA_FLAGS"]` when the run `cfg` wants deterministic GPU ops and a
    GPU backend may start; returns the start-up line to print (None: nothing to say). Call it
    before JAX initialises its backend (the CLI does); afterwards it warns and changes nothing.
    """
    if not wants_determinism(cfg) or not may_use_gpu(env.get("JAX_PLATFORMS", "")):
        return None
    why = "" if cfg.train.deterministic is True else " (auto: the run checkpoints before its end)"
    flags = env.get("XLA_FLAGS", "")
    given = flag_value(flags)
    if given is not None:
        state = "on" if given.lower() in ("true", "1") else f"off ({FLAG_NAME}={given})"
        return f"deterministic GPU ops: {state}, as XLA_FLAGS already says{why}"
    if backend_started():
        return (
            f"warning: train.deterministic cannot take effect: JAX's backend is already "
            f"initialised; set XLA_FLAGS={FLAG} before it starts{why}"
        )
    env["XLA_FLAGS"] = with_flag(flags)
    return f"deterministic GPU ops: on, {FLAG} added to XLA_FLAGS (slower scatters){why}"
