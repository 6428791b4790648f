"""Multi-process (multi-host) start-up: when and how to call `jax.distributed.initialize`.

The `distributed:` config section and the launcher's environment decide; `initialize_from` is
called by the CLI once, before JAX touches a device (config loading never initialises anything).
Environment variables read (by the CLI, passed in as a mapping): `JAX_COORDINATOR_ADDRESS`
(host:port of process 0), `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; under SLURM (`SLURM_JOB_ID` with
`SLURM_NTASKS` > 1) or Open MPI (`OMPI_COMM_WORLD_SIZE` > 1) JAX detects all three itself.

Example:
    >>> init_kwargs(DistributedConfig(), {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    ...             "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    {'coordinator_address': '10.0.0.1:1234', 'num_processes': 2, 'process_id': 1}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from nvfp4_train.errors import ConfigError

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run.

    Attributes:
        initialize: "auto" (join when the config, the environment or a detected cluster says there
            is more than one process), "always", or "never" (single process).
        coordinator_address: host:port of process 0 ("" = `JAX_COORDINATOR_ADDRESS` or detected).
        num_processes: processes in the run (0 = `JAX_NUM_PROCESSES` or detected).
        process_id: this process's index (-1 = `JAX_PROCESS_ID` or detected).
        cpu_collectives: collectives between CPU processes: "gloo" or "none" (GPU runs use NCCL
            regardless).
    """

    initialize: Literal["auto", "always", "never"] = "auto"
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    cpu_collectives: Literal["gloo", "none"] = "gloo"

    def __post_init__(self) -> None:
        if self.initialize not in ("auto", "always", "never"):
            raise ValueError(
                "distributed.initialize must be one of 'auto', 'always', 'never', "
                f"got {self.initialize!r}"
            )
        if self.num_processes < 0:
            raise ValueError(
                f"distributed.num_processes must be >= 0 (0: from env), got {self.num_processes}"
            )
        if self.process_id < -1:
            raise ValueError(
                f"distributed.process_id must be >= -1 (-1: from env), got {self.process_id}"
            )


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _cluster_detected(env: Mapping[str, str]) -> bool:
    slurm = "SLURM_JOB_ID" in env and (_env_int(env, "SLURM_NTASKS") or 1) > 1
    return slurm or (_env_int(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1


def init_kwargs(cfg: DistributedConfig, env: Mapping[str, str]) -> dict[str, Any] | None:
    """Keyword arguments for `jax.distributed.initialize`, or None to stay single-process.

    Config values win over the environment; what neither gives is left to JAX's cluster detection.

    Raises:
        ConfigError: a malformed environment value, or a process id outside [0, num_processes).
    """
    if cfg.initialize == "never":
        return None
    address = cfg.coordinator_address or env.get(ENV_ADDRESS, "").strip() or None
    count = cfg.num_processes or _env_int(env, ENV_COUNT)
    pid = cfg.process_id if cfg.process_id >= 0 else _env_int(env, ENV_ID)
    if cfg.initialize == "auto" and not ((count or 1) > 1 or _cluster_detected(env)):
        return None
    if count is not None and pid is not None and not 0 <= pid < count:
        raise ConfigError(f"distributed.process_id must be in [0, {count}), got {pid}")
    kwargs = {"coordinator_address": address, "num_processes": count, "process_id": pid}
    return {k: v for k, v in kwargs.items() if v is not None}


def initialize_from(cfg: DistributedConfig, env: Mapping[str, str]) -> bool:
    """Joins the multi-process run `cfg` / `env` describe; returns whether it did.

    Must run before JAX initialises its backends (before any array or device query).
    """
    kwargs = init_kwargs(cfg, env)
    if kwargs is None:
        return False
    import jax

    if cfg.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    jax.distributed.initialize(**kwargs)
    return True
