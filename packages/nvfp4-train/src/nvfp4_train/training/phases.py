"""The compiled steps of a run's precision phases.

`precision.precision_phases` splits a run into phases (the late BF16 forward of
`precision.bf16_forward_from`, the windows of `precision.schedule`), each with its table of
recipes. `CompiledPhases` builds the jitted train, eval and telemetry steps of a phase when the
run first reaches it; phases with the same recipes share one `Phase`, so a run compiles one train
step per distinct table of recipes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec

from nvfp4_ops import Recipe
from nvfp4_train.config.run_config import Config
from nvfp4_train.mesh.sharding import batch_sharding
from nvfp4_train.model.config import linear_paths
from nvfp4_train.observe.telemetry import make_telemetry_probe
from nvfp4_train.optim.optimizer import make_optimizer
from nvfp4_train.precision.policy import bf16_forward_start, precision_phases
from nvfp4_train.precision.schedule import phase_changes
from nvfp4_train.training.resume import run_train_step
from nvfp4_train.training.step import make_eval_step, model_graphdef, model_spec


class Phase(NamedTuple):
    """The step functions of one table of recipes (of one or more precision phases), jitted with
    the state's shardings (compiled when first called)."""

    train: Callable
    eval: Callable
    probe: Callable


class CompiledPhases:
    """The step functions of every precision phase of `cfg`, built when first asked for.

    Args:
        cfg: the run config (`model.vocab_size` set).
        graphdef: the model of the run's first table of recipes (the state's).
        mesh: the run's device mesh.
        state_sharding: the train state's shardings (the jitted steps keep them).
        say: where the compile time and phase changes are announced.
    """

    def __init__(self, cfg: Config, graphdef: Any, mesh, state_sharding: Any, say) -> None:
        self.cfg, self.mesh, self.state_sh, self.say = cfg, mesh, state_sharding, say
        self.optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.spec = model_spec(cfg)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sh = batch_sharding(mesh, cfg.train.batch_size)
        self.schedule = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
        self.paths = linear_paths(cfg.model)
        self._graphdefs = {self._key(self.spec.recipes): graphdef}
        self._phases: dict[tuple, Phase] = {}
        self._compiled: dict[tuple, Callable] = {}

    def _key(self, recipes: dict[str, Recipe]) -> tuple[Recipe, ...]:
        return tuple(recipes[p] for p in self.paths)

    def graphdef(self, recipes: dict[str, Recipe]) -> Any:
        """The model graphdef with `recipes` (one per distinct table)."""
        key = self._key(recipes)
        if key not in self._graphdefs:
            self._graphdefs[key] = model_graphdef(self.spec, recipes)
        return self._graphdefs[key]

    def phase(self, index: int) -> Phase:
        """The jitted steps of precision phase `index` (shared by phases with equal recipes)."""
        recipes = self.schedule[index].recipes
        key = self._key(recipes)
        if key not in self._phases:
            self._phases[key] = self._jitted(self.graphdef(recipes))
        return self._phases[key]

    def _jitted(self, graphdef: Any) -> Phase:
        """The jitted steps of `graphdef` with the state's shardings."""
        train, mesh, state_sh = self.cfg.train, self.mesh, self.state_sh
        step = run_train_step(self.cfg, graphdef, self.optimizer, mesh)
        probe = make_telemetry_probe(
            graphdef, self.cfg.model, grad_accum_steps=train.grad_accum_steps, mesh=mesh
        )
        return Phase(
            train=jax.jit(
                step,
                in_shardings=(state_sh, self.batch_sh),
                out_shardings=(state_sh, self.replicated),
                donate_argnums=0,
            ),
            eval=jax.jit(
                make_eval_step(graphdef, seed=train.seed, mesh=mesh),
                in_shardings=(state_sh.params, self.batch_sh),
                out_shardings=self.replicated,
            ),
            probe=jax.jit(probe, out_shardings=self.replicated),
        )

    def compiled_train(self, index: int, state: Any, batch: Any) -> Callable:
        """Phase `index`'s train step compiled for `state` and `batch` (once per distinct table
        of recipes); says how long compiling took."""
        key = self._key(self.schedule[index].recipes)
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = self.phase(index).train.lower(state, batch).compile()
            self.say(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
        return self._compiled[key]

    def announce(self, completed: int, index: int) -> None:
        """Says which precision phase the steps after `completed` run in, when it is not the
        first (with only `precision.bf16_forward_from`: that the forward runs in BF16)."""
        precision, phase = self.cfg.precision, self.schedule[index]
        if not precision.schedule:
            switch = bf16_forward_start(precision, self.cfg.train.steps)
            if switch is not None and completed >= switch and phase.start >= switch:
                what = "now run" if completed == switch else f"run (since step {switch})"
                self.say(
                    f"step {completed}: forward GEMMs of the quantized linears {what} in BF16 "
                    f"(precision.bf16_forward_from={precision.bf16_forward_from})"
                )
            return
        if index == 0:
            return
        since = "starts" if completed == phase.start else f"runs since step {phase.start}"
        changes = phase_changes(self.schedule[index - 1], phase, self.paths)
        self.say(
            f"step {completed}: precision phase {index + 1} of {len(self.schedule)}, completed "
            f"steps {phase.label}, {since}: {changes}"
        )
