"""What the training loop watches for besides the loss: a run that diverged (consecutive
non-finite steps, `train.stop_after_nonfinite`) and the health of every linear's quantization
(telemetry rows and the warnings `observe.health` draws from them)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.config.run_config import Config
from nvfp4_train.errors import RunError
from nvfp4_train.mesh.sharding import host_value
from nvfp4_train.observe.health import make_health_tracker
from nvfp4_train.observe.metrics import RunOutputs, quant_row


class Watch:
    """The divergence streak and the quantization health of one training session."""

    def __init__(self, cfg: Config, ckpts: Checkpoints) -> None:
        self.limit = cfg.train.stop_after_nonfinite
        self.ckpts = ckpts
        self.streak = (0, 0)  # (how many, first step) of the latest consecutive non-finite steps
        self.health = make_health_tracker(cfg.logging.quant_health)
        self.health_state = self.health.init()

    def check_divergence(self, host: list, last_step: int) -> None:
        """Counts the non-finite steps among `host` (the host metrics of the steps ending at
        `last_step`).

        Raises:
            RunError: `train.stop_after_nonfinite` consecutive steps were skipped or had a
                non-finite loss.
        """
        for step in range(last_step - len(host) + 1, last_step + 1):
            metrics = host[step - last_step - 1]
            bad = bool(metrics["skipped"]) or not np.isfinite(float(metrics["loss"]))
            count, first = self.streak
            self.streak = (count + 1, first if count else step) if bad else (0, 0)
        count, first = self.streak
        if self.limit and count >= self.limit:
            kept = self.ckpts.latest_step()
            raise RunError(
                f"training diverged: the {count} steps {first}..{last_step} were all "
                "skipped as non-finite or had a non-finite loss (train.stop_after_nonfinite="
                f"{self.limit}); stopping. "
                + (f"The newest checkpoint, step {kept}, is kept. " if kept is not None else "")
                + "Lower optimizer.learning_rate (or check the data) and run again."
            )  # fmt: skip

    def report_quant(self, outputs: RunOutputs, step: int, telemetry: Any) -> None:
        """Writes the telemetry row of `step` (the probe's `{"quant": ..., "ssm": ...}`,
        `telemetry.make_telemetry_probe`) and prints the health warnings it raises."""
        host = jax.tree.map(host_value, telemetry)
        row = quant_row(step, host["quant"], host.get("ssm"))
        outputs.write_quant(row)
        self.health_state, lines = self.health.update(self.health_state, row["quant"], step=step)
        for line in lines:
            outputs.progress.message(line)
