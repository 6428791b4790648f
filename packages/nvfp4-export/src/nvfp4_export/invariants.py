"""Layout invariants of an export directory (names, dtypes, shapes, shared scales, metadata,
config.json field by field, a tokenizer that loads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nvfp4_export.errors import ExportError
from nvfp4_export.formats import (
    BF16,
    COMPRESSED_TENSORS,
    FORMATS,
    MIXED,
    MODELOPT,
    stored_format,
    stored_recipes,
)
from nvfp4_export.hf_files import dense_hf_names, hf_config, special_token_ids
from nvfp4_export.hybrid_names import LAYERS
from nvfp4_export.json_files import canonical_json
from nvfp4_export.layouts import (
    FUSED_MODULES,
    LayoutPlan,
    fused_exclusions,
    hf_quant_config,
    quantization_config,
)
from nvfp4_export.linears import hf_modules, in_features
from nvfp4_export.model_spec import ARCHITECTURES, dense_entries
from nvfp4_export.moe_spec import EXPERT_LINEARS
from nvfp4_export.policy import weight_format
from nvfp4_export.reload import LoadedExport
from nvfp4_export.shard_writer import INDEX_FILE
from nvfp4_format.layout_names import LAYOUT_NAMES, WEIGHT, WEIGHT_SCALE

FUSED = tuple(parts for _, parts in FUSED_MODULES)
"""The module groups that must share their global and input scales."""
SHARED_SCALE_SUFFIXES = tuple(
    suffix
    for suffix in dict.fromkeys(
        [n.global_scale for n in LAYOUT_NAMES.values()]
        + [n.input_scale for n in LAYOUT_NAMES.values()]
    )
    if suffix is not None
)
"""weight_scale_2, weight_global_scale, input_scale, input_global_scale: equal across a group."""
_MODELOPT_KEYS = ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")
TOKENIZER_FILE = "tokenizer.json"
_MISSING = object()


def _expected(fmt: str, layout: str, w4a4: bool, out: int, inp: int) -> dict | None:
    """tensor suffix -> (dtype name, shape) for one module stored in `fmt` ("bf16" or a
    `FORMATS` name; None: `fmt` has no `layout`)."""
    if fmt == BF16:
        return {WEIGHT: ("bfloat16", (out, inp))}
    f = FORMATS.get(fmt)
    names = None if f is None else f.layouts.get(layout)
    if names is None:
        return None
    packed = "uint8" if f.elements_per_byte == 2 else "float8_e4m3fn"
    exp = {names.packed: (packed, (out, inp // f.elements_per_byte))}
    if names.block_scales is not None:
        exp[names.block_scales] = (f.scale_dtype, (out, inp // f.block_size))
    if names.global_scale is not None:
        exp[names.global_scale] = ("float32", names.scalar_shape)
    if w4a4 and names.input_scale is not None:
        exp[names.input_scale] = ("float32", names.scalar_shape)
    return exp


def _module_problems(loaded: LoadedExport, name: str, exp: dict, seen: set) -> list[str]:
    problems = []
    for suffix, (dtype, shape) in exp.items():
        full = f"{name}.{suffix}"
        seen.add(full)
        t = loaded.tensors.get(full)
        if t is None:
            problems.append(f"missing tensor {full}")
        elif t.dtype.name != dtype or tuple(t.shape) != shape:
            problems.append(
                f"{full}: expected {dtype}{list(shape)}, got {t.dtype.name}{list(t.shape)}"
            )
    return problems


def _shared_scale_problems(loaded: LoadedExport, layer: int) -> list[str]:
    problems, prefix = [], LAYERS if loaded.spec.hybrid else "model.layers"
    for group in FUSED:
        for suffix in SHARED_SCALE_SUFFIXES:
            values = [loaded.tensors.get(f"{prefix}.{layer}.{m}.{suffix}") for m in group]
            present = [np.asarray(v).reshape(-1)[0] for v in values if v is not None]
            if present and (len(present) != len(group) or len(set(present)) != 1):
                problems.append(f"layer {layer} {group}: {suffix} not shared: {present}")
    return problems


def _linear_problems(loaded: LoadedExport) -> list[str]:
    spec, prov = loaded.spec, loaded.provenance
    excluded = set(prov.get("excluded") or [])
    problems, seen = [], set()
    for source in spec.linear_paths():
        fmt = _linear_format(loaded, source)
        for name, rows in hf_modules(spec, source):
            inp = in_features(spec, source)
            exp = _expected(fmt, loaded.layout, prov["w4a4"], rows, inp)
            if exp is None:
                problems.append(
                    f"{name}: format {prov['format']!r} is not written in layout {loaded.layout!r}"
                )
            else:
                problems += _module_problems(loaded, name, exp, seen)
            if (fmt == BF16) != (name in excluded):
                problems.append(
                    f"{name}: {'BF16 but not' if fmt == BF16 else 'quantized but'} listed as excluded"
                )
    for i in range(spec.num_layers):
        problems += _shared_scale_problems(loaded, i)
    problems += expert_scale_problems(loaded) + _dense_dtype_problems(loaded, seen)
    extra = sorted(set(loaded.tensors) - seen)
    return problems + ([f"unexpected tensors {extra[:5]}"] if extra else [])


def _linear_format(loaded: LoadedExport, source: str) -> str:
    """The format training linear `source` is stored in: "bf16", the manifest's `format`, or
    for a mixed export its own (`formats.stored_format`; "?" when the layout cannot hold it)."""
    recipe = stored_recipes(loaded.layout, loaded.provenance["recipes"])[source]
    if recipe == BF16 or loaded.provenance["format"] != MIXED:
        return BF16 if recipe == BF16 else loaded.provenance["format"]
    try:
        return stored_format(weight_format(recipe, source).fmt, loaded.layout)
    except ExportError:  # an unknown recipe in an edited manifest
        return "?"


def _dense_dtype_problems(loaded: LoadedExport, seen: set) -> list[str]:
    """Every dense tensor present in the dtype export stores it in (BF16; float32 for the
    Mamba conv and SSM parameters)."""
    problems, spec = [], loaded.spec
    for t in dense_entries(spec):
        for name in dense_hf_names(spec, t):
            seen.add(name)
            if name not in loaded.tensors or loaded.tensors[name].dtype.name != t.dtype:
                problems.append(f"{name}: missing or not {t.dtype}")
    return problems


def plan_of_export(loaded: LoadedExport) -> LayoutPlan:
    """The `LayoutPlan` an export was written with, rebuilt from its manifest and spec."""
    spec, prov = loaded.spec, loaded.provenance
    modules = tuple(
        (name, fmt)
        for source in spec.linear_paths()
        if (fmt := _linear_format(loaded, source)) != BF16
        for name, _ in hf_modules(spec, source)
    )
    excluded = tuple(prov.get("excluded") or [])
    return LayoutPlan(loaded.layout, prov["format"], prov["w4a4"], excluded,
                      bool(spec.num_experts), modules)  # fmt: skip


def expert_scale_problems(loaded: LoadedExport) -> list[str]:
    """Every routed expert's global and input scales, as the MoE loaders need them: gate and up
    of an expert share one global scale and one input scale (vLLM keeps the gate's and warns,
    TensorRT-LLM asserts `w1_weight_scale_2 == w3_weight_scale_2` and `w1_input_scale ==
    w3_input_scale`), and no scale is zero (a zero input scale serves NaN in vLLM). Missing and
    non-finite ones are the module and non-finite checks'."""
    spec, problems = loaded.spec, []
    for i in spec.moe_layers():
        for kind in EXPERT_LINEARS:
            for e in range(spec.num_experts):
                modules = [n for n, _ in hf_modules(spec, f"layers.{i}.{kind}", e)]
                for suffix in SHARED_SCALE_SUFFIXES:
                    values = [loaded.tensors.get(f"{m}.{suffix}") for m in modules]
                    present = [float(np.asarray(v).reshape(-1)[0]) for v in values if v is not None]
                    if len(set(present)) > 1:
                        problems.append(f"layer {i} expert {e}: {suffix} of {modules} differ: "
                                        f"{present}")  # fmt: skip
                    if any(v == 0 for v in present):
                        problems.append(f"layer {i} expert {e}: a zero {suffix} in {modules}")
    return problems


def _metadata_problems(loaded: LoadedExport) -> list[str]:
    cfg, prov, problems = loaded.config, loaded.provenance, []
    arch = loaded.spec.architecture
    if cfg.get("architectures") != [ARCHITECTURES[arch]] or cfg.get("model_type") != arch:
        problems.append(f"config.json is not a {ARCHITECTURES[arch]} config")
    if prov["format"] == MIXED:
        return problems + _mixed_metadata_problems(loaded)
    qc = cfg.get("quantization_config")
    excluded = prov.get("excluded") or []
    expected = sorted([*excluded, *fused_exclusions(tuple(excluded))])
    if prov["format"] == BF16:
        return problems + (["a BF16 export must have no quantization_config"] if qc else [])
    if loaded.layout == COMPRESSED_TENSORS:
        fmt = FORMATS[prov["format"]].ct_format if prov["format"] in FORMATS else None
        if not qc or qc.get("quant_method") != "compressed-tensors" or qc.get("format") != fmt:
            problems.append(f"quantization_config must be compressed-tensors format {fmt}")
        elif sorted(qc.get("ignore", [])) != expected:
            problems.append(
                "quantization_config.ignore does not list exactly the BF16 modules and their "
                "fused groups"
            )
        return problems
    hq = (loaded.hf_quant_config or {}).get("quantization")
    if not hq or "producer" not in (loaded.hf_quant_config or {}):
        return problems + ["hf_quant_config.json missing, or without producer/quantization"]
    problems += [f"hf_quant_config.json lacks {k}" for k in _MODELOPT_KEYS if k not in hq]
    if sorted(hq.get("exclude_modules", [])) != expected:
        problems.append(
            "exclude_modules does not list exactly the BF16 modules and their fused groups"
        )
    if (
        not qc
        or qc.get("quant_method") != "modelopt"
        or qc.get("quant_algo") != hq.get("quant_algo")
    ):
        problems.append("config.json quantization_config must be modelopt with the same quant_algo")
    return problems


def _mixed_metadata_problems(loaded: LoadedExport) -> list[str]:
    """A mixed export's `quantization_config` (and `hf_quant_config.json`) against what the
    export writes for its rebuilt plan: every module's format, the exclusions, the groups."""
    plan, problems = plan_of_export(loaded), []
    if loaded.config.get("quantization_config") != quantization_config(plan):
        problems.append("quantization_config is not the one the export writes for its modules "
                        "and formats")  # fmt: skip
    if plan.layout == MODELOPT and loaded.hf_quant_config != hf_quant_config(plan):
        problems.append("hf_quant_config.json is not the one the export writes for its modules "
                        "and formats")  # fmt: skip
    return problems


def _file_problems(loaded: LoadedExport) -> list[str]:
    from nvfp4_format.safetensors_header import read_safetensors_header

    problems = []
    for file in loaded.files:
        if read_safetensors_header(loaded.path / file).metadata.get("format") != "pt":
            problems.append(f"{file}: safetensors metadata lacks format=pt")
    if (loaded.path / INDEX_FILE).is_file():
        from nvfp4_format.safetensors_index import read_safetensors_index

        index = read_safetensors_index(loaded.path / INDEX_FILE)
        if set(index.weight_map) != set(loaded.tensors):
            problems.append("index weight_map does not cover exactly the stored tensors")
    return problems + _tokenizer_problems(loaded.path)


def config_problems(loaded: LoadedExport) -> list[str]:
    """config.json field by field against what the export writes for its spec (the manifest's):
    every field equal as JSON (`rms_norm_eps`, `rope_scaling`, `num_key_value_heads`, ...), no
    field the export does not write; `quantization_config` is the metadata check's. The special
    token ids are compared when the export's tokenizer names them."""
    bos, eos = special_token_ids(loaded.path)
    want = hf_config(loaded.spec, eos_token_id=eos, bos_token_id=bos)
    if eos is None:  # no readable tokenizer (reported there): nothing to compare the ids with
        want = {k: v for k, v in want.items() if k not in ("bos_token_id", "eos_token_id")}
    problems = []
    for key, value in want.items():
        got = loaded.config.get(key, _MISSING)
        if got is _MISSING:
            problems.append(f"config.json lacks {key!r} (the export wrote {value!r})")
        elif canonical_json(got) != canonical_json(value):
            problems.append(f"config.json {key} is {got!r}, but the exported model has {value!r}")
    written = {*want, "quantization_config", "bos_token_id", "eos_token_id"}
    extra = sorted(set(loaded.config) - written)
    if extra:
        problems.append(f"config.json has fields the export does not write: {extra[:5]}")
    return problems


def _tokenizer_problems(path: Path) -> list[str]:
    if not (path / TOKENIZER_FILE).is_file():
        return [f"no {TOKENIZER_FILE}"]
    import tokenizers

    try:
        tokenizers.Tokenizer.from_file(str(path / TOKENIZER_FILE))
    except Exception as err:  # tokenizers raises a plain Exception for a broken file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return [f"{TOKENIZER_FILE} does not load with the tokenizers library: {first}"]
    return []


def nonfinite_problems(loaded: LoadedExport) -> list[str]:
    """Tensors holding NaN or Inf: weights, norms, block scales (E4M3 NaN, or the E8M0 NaN byte
    255 of MXFP4 scales), global and input scales. Nothing finite can be computed from them."""
    problems = []
    names = loaded.provenance.get("formats") or [loaded.provenance.get("format")]
    bytes_ = [FORMATS[n].nan_scale_byte for n in names if n in FORMATS]
    nan_byte = next((b for b in bytes_ if b is not None), None)
    for name, tensor in sorted(loaded.tensors.items()):
        if tensor.dtype == np.uint8:
            is_scale = nan_byte is not None and name.endswith(WEIGHT_SCALE)
            bad = int((tensor == nan_byte).sum()) if is_scale else 0
        else:
            bad = int((~np.isfinite(tensor.astype(np.float32))).sum())
        if bad:
            problems.append(f"{name}: {bad} NaN or Inf value(s)")
    return problems


def layout_problems(loaded: LoadedExport) -> list[str]:
    """Every broken invariant of the export (empty when it is sound)."""
    problems = _metadata_problems(loaded) + config_problems(loaded) + _file_problems(loaded)
    return problems + _linear_problems(loaded) + nonfinite_problems(loaded)
