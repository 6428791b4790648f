"""Whether a run fits its devices: `check_memory_fits` compares the per-device estimate of
`memory.estimate_memory` (what `show-config --memory` prints) with what one device holds, before
anything is compiled or written, so a model that cannot fit is one error line, not minutes of
compiling, an out-of-memory traceback and a run directory. `train.memory_check=false` skips it.

What a device holds (`device_capacity`): a GPU's allocator limit (`memory_stats()["bytes_limit"]`),
a CPU device's share of the host's physical RAM (the local CPU devices share it). A device that
reports neither is not checked.

Example:
    >>> memory_refusal(600 * GIB, (23 * GIB, "host RAM 23.0 GiB over 1 CPU device"))[:40]
    'the run needs about 600.0 GiB per device'
"""

from __future__ import annotations

import os
from typing import Any

import jax

from nvfp4_train.errors import ConfigError
from nvfp4_train.model.blocks.attention import run_attention
from nvfp4_train.training.memory import GIB, MemoryEstimate, estimate_memory

OVERRIDE = "train.memory_check=false"


def host_ram() -> int | None:
    """Bytes of physical RAM on this host (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_capacity(device: Any, local_devices: int) -> tuple[int, str] | None:
    """(bytes one device may use, where that figure comes from) for `device`, one of
    `local_devices` devices of this process; None when the device does not say."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if limit:
        return int(limit), f"{device.device_kind} memory limit"
    ram = host_ram() if device.platform == "cpu" else None
    if not ram:
        return None
    plural = "s" if local_devices > 1 else ""
    return (
        ram // local_devices,
        f"host RAM {ram / GIB:.1f} GiB over {local_devices} CPU device{plural}",
    )


def memory_refusal(
    needed: int, capacity: tuple[int, str], estimate: MemoryEstimate | None = None
) -> str | None:
    """The one-line refusal when `needed` bytes per device exceed `capacity` (else None)."""
    limit, source = capacity
    if needed <= limit:
        return None
    parts = ""
    if estimate is not None:
        parts = (
            f" (parameters {estimate.parameters / GIB:.1f}, optimizer state "
            f"{estimate.optimizer / GIB:.1f}, gradients {estimate.gradients / GIB:.1f}, "
            f"activations {estimate.activations / GIB:.1f} GiB)"
        )
    return (
        f"the run needs about {needed / GIB:.1f} GiB per device{parts} by the estimate of "
        f"show-config --memory, but a device holds {limit / GIB:.1f} GiB ({source}); make the "
        f"model, batch or sequence smaller, use more devices, or set {OVERRIDE} to try anyway"
    )


def check_memory_fits(cfg: Any, devices: list, local_devices: int) -> None:
    """Raises ConfigError when the estimate for a run of `cfg` (`model.vocab_size` set) on
    `devices` exceeds what one of them holds, unless `train.memory_check` is false. Only a
    device of this process is asked (another process's device cannot answer here: asking one
    in a two-process run made their first collective time out: tests/test_distributed.py)."""
    if not cfg.train.memory_check or not devices:
        return
    here = jax.process_index()
    device = next((d for d in devices if getattr(d, "process_index", here) == here), None)
    capacity = device_capacity(device, local_devices) if device is not None else None
    if capacity is None:
        return
    attention = run_attention(cfg, device.platform)
    estimate = estimate_memory(cfg, len(devices), attention)
    refusal = memory_refusal(estimate.total, capacity, estimate)
    if refusal:
        raise ConfigError(refusal)
