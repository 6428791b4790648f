"""`verify`'s check of the exported input (activation) scale tensors, bit for bit.

A server quantizes each linear's input with the `input_scale` (ModelOpt, a DECODE scale) or
`input_global_scale` (compressed-tensors, an ENCODE scale) tensor it loads, not with the amax the
manifest records; so every such tensor, of every linear and every expert, is compared with the
scale re-derived the way the export derives it (`layouts.scale_of_amax`): from the run's
`quant_stats.activation_amax` (idle experts filled as `expert_scales` does), or, for an export
calibrated with --calibrate (or without --against), from the amax its manifest records.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nvfp4_export.calibrate import amax_from_stats
from nvfp4_export.checkpoint import QUANT_STATS_ITEM
from nvfp4_export.errors import ExportError
from nvfp4_export.expert_scales import resolve_expert_amax
from nvfp4_export.formats import FORMAT_OF_LAYOUT, LAYOUT_NAMES, calibrated_input
from nvfp4_export.layouts import scale_of_amax
from nvfp4_export.linears import hf_modules
from nvfp4_export.manifest import MANIFEST
from nvfp4_export.model_spec import LlamaSpec
from nvfp4_export.moe_spec import is_expert_linear
from nvfp4_export.reload import LoadedExport


def has_input_scales(loaded: LoadedExport) -> bool:
    """The export is W4A4 with a format whose input scales are calibrated (NVFP4, FP8)."""
    formats = loaded.provenance.get("formats") or [loaded.provenance["format"]]
    return bool(loaded.provenance.get("w4a4")) and any(map(calibrated_input, formats))


def expected_input_amax(loaded: LoadedExport, quant_stats) -> tuple[dict, str]:
    """(linear path -> the input amax the export's scales must come from, where from).

    From the run's `quant_stats` (a dict: the run is given) when the export took its amax from
    there, else from the amax the manifest records.

    Raises:
        ExportError: the run's activation amax cannot be read.
    """
    recorded = loaded.provenance.get("input_amax")
    recorded = recorded if isinstance(recorded, dict) else {}
    if quant_stats is None or loaded.provenance.get("input_amax_from") != QUANT_STATS_ITEM:
        return recorded, f"the input amax recorded in {MANIFEST}"
    spec, recipes = loaded.spec, loaded.provenance["recipes"]
    amax = amax_from_stats(quant_stats, spec.linear_paths())
    if spec.num_experts:
        amax, _ = resolve_expert_amax(spec, recipes, amax, allow_uncalibrated=True)
    return amax, f"the run's {QUANT_STATS_ITEM}.activation_amax"


def input_scale_check(loaded: LoadedExport, quant_stats) -> tuple[list[str], str | None]:
    """(problems of the exported input scale tensors, a note on what they were not compared
    with, or None). `quant_stats`: the run's (`{}` when it has none), None without a run."""
    if not has_input_scales(loaded):
        return [], None
    try:
        amax, origin = expected_input_amax(loaded, quant_stats)
    except ExportError as err:
        return [f"input scales: the run's activation amax cannot be read: {err}"], None
    note = None
    if quant_stats is not None and loaded.provenance.get("input_amax_from") != QUANT_STATS_ITEM:
        note = (f"input scales vs the run's activation amax: the export calibrated them "
                f"(--calibrate), which verify does not repeat; compared with {origin}")  # fmt: skip
    return input_scale_problems(loaded, amax, origin), note


def module_amax(spec: LlamaSpec, source: str, amax, count: int) -> list:
    """The input amax of each of `count` HF modules of `source`: a routed experts' list spread
    over each expert's modules, else the one value for all."""
    if not is_expert_linear(source) or not isinstance(amax, (list, tuple)):
        return [amax] * count
    per = count // spec.num_experts
    return [amax[k // per] if k // per < len(amax) else None for k in range(count)]


def input_scale_problems(loaded: LoadedExport, amax: Mapping, origin: str) -> list[str]:
    """Each exported input scale tensor that is not the scale of its linear's amax in `amax`
    (bit for bit), naming the tensor, the expected and the found value."""
    spec, problems = loaded.spec, []
    for source in spec.linear_paths():
        modules = [name for name, _ in hf_modules(spec, source)]
        values = module_amax(spec, source, amax.get(source), len(modules))
        for name, value in zip(modules, values, strict=True):
            problem = _module_problem(loaded, name, source, value, origin)
            if problem:
                problems.append(problem)
    return problems


def _module_problem(loaded: LoadedExport, name: str, source: str, value, origin: str):
    q = loaded.quantized_modules.get(name)
    suffix = None if q is None else LAYOUT_NAMES[q.layout].input_scale
    if suffix is None:
        return None  # BF16 or MXFP4: no input scale
    names, tensor = LAYOUT_NAMES[q.layout], f"{name}.{suffix}"
    if q.input_scale is None or np.asarray(loaded.tensors[tensor]).size != 1:
        return None  # missing or misshapen: reported by the layout invariants
    found = np.float32(np.asarray(loaded.tensors[tensor]).reshape(()))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{tensor} is {found:.9g}, but {origin} holds no input amax for {source}"
    expected = np.float32(scale_of_amax(np.float32(value), names, FORMAT_OF_LAYOUT[q.layout]))
    if found.tobytes() == expected.tobytes():
        return None
    return (f"{tensor} is {found:.9g}, expected {expected:.9g} (the scale of {source}'s input "
            f"amax {float(value):.9g} in {origin})")  # fmt: skip
