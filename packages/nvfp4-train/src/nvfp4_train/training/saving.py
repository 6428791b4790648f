"""What a run writes into each checkpoint besides its state: the quantization facts an export
needs (`quant_stats`: the presets the weights are quantized as and the activation amax of every
quantized linear) and the reference logits of fixed tokens (`reference`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nvfp4_ops import get_recipe
from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.config.loader import to_dict
from nvfp4_train.config.run_config import Config
from nvfp4_train.mesh.sharding import host_value
from nvfp4_train.precision.schedule import forward_weight_names
from nvfp4_train.training.phases import CompiledPhases
from nvfp4_train.training.step import flat_amax, forward


class CheckpointWriter:
    """Saves the checkpoints of one training session.

    `quant_stats["recipes"]` holds `schedule.forward_weight_names` (the presets an export
    quantizes the weights as) and the reference logits come from their quantized forward, also
    after a `precision.bf16_forward_from` switch or a schedule's BF16 Fprop.
    `quant_stats["activation_amax"]` holds a float per quantized linear, a list of one per
    expert for an MoE block's expert linears.

    Args:
        cfg: the run config.
        ckpts: the run's checkpoints.
        phases: the run's compiled phases (for the graphdef of the exported recipes).
        reference_tokens: int32 [n, L] tokens of the `reference` item, or None for none.
    """

    def __init__(self, cfg: Config, ckpts: Checkpoints, phases: CompiledPhases,
                 reference_tokens: np.ndarray | None) -> None:  # fmt: skip
        self.ckpts, self.reference_tokens = ckpts, reference_tokens
        self.config_dict = to_dict(cfg)
        self.recipes = forward_weight_names(phases.schedule, cfg.train.steps)
        exported = phases.graphdef({p: get_recipe(n) for p, n in self.recipes.items()})
        seed = cfg.train.seed
        self.forward = jax.jit(
            lambda p, t: forward(exported, p, t, jax.random.key(seed)),
            in_shardings=(phases.state_sh.params, phases.replicated),
            out_shardings=phases.replicated,
        )

    def save(self, step: int, state: Any, iterator: Any) -> None:
        """Writes the checkpoint of `step` with its quant_stats and reference items."""
        amax = {k: _floats(host_value(v)) for k, v in flat_amax(state.activation_amax).items()}
        quantized = [p for p, name in self.recipes.items() if name != "bf16"]
        stats = {"recipes": self.recipes, "activation_amax": {p: amax[p] for p in quantized}}
        reference = None
        if self.reference_tokens is not None:
            logits = self.forward(state.params, self.reference_tokens)
            reference = {
                "tokens": self.reference_tokens,
                "logits": np.asarray(host_value(logits), np.float32),
            }
        self.ckpts.save(
            step, state, data_iter_state=iterator.get_state(), config=self.config_dict,
            quant_stats=stats, reference=reference,
        )  # fmt: skip


def _floats(value: Any) -> float | list[float]:
    """A host amax as JSON: a float, or a list of floats (an expert linear: one per expert)."""
    array = np.asarray(value, np.float64)
    return float(array) if array.ndim == 0 else array.tolist()
