"""What FSDP gathers of the linears' kernels per forward pass, by `precision.gather` (analytic).

For each linear whose kernel the sharding rules split over `fsdp` (the mesh the config resolves
to for `devices`), one gather brings each device the (fsdp - 1) / fsdp of the kernel it lacks
(of its `tensor` slice): 4 bytes per element as float32 (`master`), 2 as BF16 (`compute`),
0.5625 as NVFP4 codes and E4M3 tile scales (`quantized`), each linear in the mode
`model.weight_gather.mode_for` gives it (BF16-policy linears in BF16 under `compute` and
`quantized`) under the base recipes.
One gather per microbatch forward; XLA may gather a weight again for the backward pass in
`master` (docs/benchmarks/comms.md measures a compiled step).

Example:
    >>> BYTES_PER_ELEMENT
    {'master': 4.0, 'compute': 2.0, 'quantized': 0.5625}
"""

from __future__ import annotations

import math

from jax.sharding import AbstractMesh

from nvfp4_train.mesh.sharding import AXES, kernel_axes
from nvfp4_train.mesh_axes import FSDP_AXIS, fit_axes
from nvfp4_train.model.stacking import layer_paths
from nvfp4_train.model.weight_gather import GATHER_MODES, GatherPlan, check_tiles, mode_for
from nvfp4_train.precision.policy import layer_recipes
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.tree_paths import key_names

BYTES_PER_ELEMENT = {"master": 4.0, "compute": 2.0, "quantized": 0.5625}


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _split_kernels(cfg, devices: int):
    """(dotted per-layer path, kernel shape [K, N], fitted spec, recipe, mesh) of every linear
    whose kernel the sharding rules split over `fsdp` on the mesh of `cfg` for `devices`."""
    import jax

    sizes = dict(zip(AXES, cfg.mesh.resolve(devices), strict=True))
    if sizes[FSDP_AXIS] <= 1:
        return
    mesh = AbstractMesh(tuple(sizes.values()), AXES)
    recipes = layer_recipes(cfg.model, cfg.precision)
    _, state = abstract_state(cfg)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        names = key_names(key_path)
        axes = kernel_axes(names[-2]) if len(names) >= 2 and names[-1] == "kernel" else None
        if axes is None:
            continue
        shape = tuple(leaf.shape[-2:])
        spec = fit_axes(axes, shape, sizes)
        if not any(FSDP_AXIS in _names(e) for e in spec):
            continue
        for path in layer_paths(names):
            recipe = recipes.get(path.removesuffix(".kernel"))
            if recipe is not None:
                yield path, shape, spec, recipe, mesh


def gathered_bytes(cfg, devices: int) -> dict[str, float]:
    """{precision.gather mode: bytes one device receives per forward pass for the linears'
    kernels} on the mesh `cfg.mesh` resolves to for `devices`."""
    totals = dict.fromkeys(GATHER_MODES, 0.0)
    for _, shape, spec, recipe, mesh in _split_kernels(cfg, devices):
        tensor = math.prod(mesh.shape[a] for e in spec for a in _names(e) if a != FSDP_AXIS)
        fsdp = mesh.shape[FSDP_AXIS]
        received = math.prod(shape) / tensor * (fsdp - 1) / fsdp
        for mode in GATHER_MODES:
            totals[mode] += received * BYTES_PER_ELEMENT[mode_for(mode, recipe)]
    return totals


def check_gather_tiles(cfg, devices: int) -> None:
    """Start-up check of `precision.gather=quantized`: ConfigError (naming the kernel, the
    dimension and its split) unless every quantized kernel's slices are whole 16x16 tiles."""
    if cfg.precision.gather != "quantized":
        return
    for path, shape, spec, recipe, mesh in _split_kernels(cfg, devices):
        if mode_for("quantized", recipe) == "quantized":
            fsdp_dim = next(d for d, e in enumerate(spec) if FSDP_AXIS in _names(e))
            check_tiles(GatherPlan(mesh, spec, spec, fsdp_dim), shape, path)


def format_gathers(cfg, devices: int) -> str:
    """YAML comment lines: `gathered_bytes` per mode, the configured one marked (nothing when no
    linear's kernel is split over `fsdp`)."""
    totals = gathered_bytes(cfg, devices)
    if not any(totals.values()):
        return ""
    lines = ["# FSDP weight gathers per device and microbatch forward (analytic; per element "
             "4 / 2 / 0.5625 bytes, BF16-policy linears at 2 under quantized):"]  # fmt: skip
    for mode, nbytes in totals.items():
        mark = "   <- precision.gather" if mode == cfg.precision.gather else ""
        lines.append(f"#   {mode:<10} {nbytes / 2**20:10.2f} MiB{mark}")
    return "\n".join(lines) + "\n"
