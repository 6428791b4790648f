"""The metrics window of the training loop: the steps since the last metrics row and the wall
time they took, turned into one row (`observe.metrics.summarize_window` plus throughput, the loss
scale and the validation loss)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from nvfp4_train.config.run_config import Config
from nvfp4_train.mesh.sharding import host_value
from nvfp4_train.model.flops import Throughput, device_peak, train_flops_per_token
from nvfp4_train.observe.metrics import summarize_moe, summarize_window


class MetricsWindow:
    """The per-step metrics (device arrays) of the steps since the last row, and their time.

    The time runs from `restart()` until the row's last step's metrics are on the host: steps
    are dispatched asynchronously, so the loop reaches a row long before the device has run its
    steps (timed at dispatch, tiny.yaml on CPU showed 10x its real tokens/s). Work that is not
    step time (a telemetry probe, a phase's compile) is taken out with `exclude`.

    Args:
        cfg: the run config.
        devices: how many devices the run uses.
        quantized: whether any GEMM of the run quantizes (for `mfu_fp4`).
        tokens_by_source: step -> {source: tokens read so far} of a `data.mixture` (the data's
            `Datasets.tokens_by_source`; empty without a mixture), added to each row.
    """

    def __init__(self, cfg: Config, *, devices: int, quantized: bool,
                 tokens_by_source: Callable[[int], dict] = lambda step: {}) -> None:  # fmt: skip
        self.cfg, self.tokens_by_source = cfg, tokens_by_source
        self.throughput = Throughput(
            flops_per_token=train_flops_per_token(cfg.model, seq_len=cfg.train.seq_len),
            devices=devices,
            peak=device_peak(jax.devices()[0].device_kind),
            quantized=quantized,
        )
        self.steps: list[Any] = []
        self.started = time.perf_counter()

    def restart(self) -> None:
        """Starts the time of the next window (the window must be empty)."""
        self.started = time.perf_counter()

    def add(self, step_metrics: Any) -> None:
        self.steps.append(step_metrics)

    def exclude(self, seconds: float) -> None:
        """Takes `seconds` of work that was not step time out of the window's time."""
        self.started += seconds

    def row(self, step: int) -> tuple[dict[str, Any], list]:
        """(the row of the window's steps ending at `step`, their host metrics); empties the
        window."""
        host = [jax.tree.map(host_value, m) for m in self.steps]  # waits for them
        seconds = time.perf_counter() - self.started
        train = self.cfg.train
        row = summarize_window(
            host, step=step, seconds=seconds, tokens=train.batch_size * train.seq_len * len(host),
            skipped_total=int(host[-1]["skipped_total"]),
        )  # fmt: skip
        row |= summarize_moe(host) | self.throughput.fields(row["tokens_per_s"])
        if by_source := self.tokens_by_source(step):
            row["tokens_by_source"] = by_source
        if self.cfg.optimizer.loss_scaling.mode != "none":
            row["loss_scale"] = float(host[-1]["loss_scale"])
        self.steps = []
        return row, host

    def __bool__(self) -> bool:
        return bool(self.steps)
