"""Read an export back (config, quantization metadata, tensors) and rebuild dense forward weights."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from nvfp4_export.checkpoint import Checkpoint, read_json
from nvfp4_export.dense_names import (
    EMBED,
    FINAL_NORM,
    LAYER_TENSORS,
    LM_HEAD,
    DenseTensor,
    stored_value,
)
from nvfp4_export.eight_bit_formats import detect_eight_bit_modules, fp8_decode_scale
from nvfp4_export.errors import ExportError
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import BF16, FORMAT_OF_LAYOUT, LAYOUT_NAMES, stored_recipes
from nvfp4_export.forward import ForwardLinear, ForwardWeights
from nvfp4_export.hf_files import (
    CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    dense_hf_names,
)
from nvfp4_export.linears import dequantize_linear, export_linear, hf_modules
from nvfp4_export.manifest import MANIFEST
from nvfp4_export.model_spec import LlamaSpec, dense_entries
from nvfp4_export.moe_spec import is_expert_linear
from nvfp4_export.policy import weight_format
from nvfp4_export.shard_writer import DTYPE_TAG, INDEX_FILE, SINGLE_FILE
from nvfp4_format.layout_detection import QuantizedModule, detect_quantized_modules
from nvfp4_format.layout_names import WEIGHT, LayoutNames
from nvfp4_format.safetensors_header import TensorInfo

PROVENANCE_FILE = MANIFEST


@dataclasses.dataclass(frozen=True)
class LoadedExport:
    """An export directory as data.

    Attributes:
        path: the directory.
        config: config.json.
        provenance: nvfp4_export.json (spec, recipes, step, activation-amax source).
        hf_quant_config: hf_quant_config.json or None.
        tensors: name -> array (every shard merged).
        files: the safetensors files read.
    """

    path: Path
    config: dict[str, Any]
    provenance: dict[str, Any]
    hf_quant_config: dict[str, Any] | None
    tensors: dict[str, np.ndarray]
    files: tuple[str, ...]

    @property
    def spec(self) -> LlamaSpec:
        return LlamaSpec(**self.provenance["spec"])

    @property
    def layout(self) -> str:
        return self.provenance["layout"]

    @functools.cached_property
    def quantized_modules(self) -> Mapping[str, QuantizedModule]:
        """Module name -> its quantized tensors: the FP4 modules `nvfp4_format.layout_detection`
        detects and the 8-bit ones (`eight_bit_formats.detect_eight_bit_modules`)."""
        infos = tensor_infos(self.tensors)
        found = detect_quantized_modules(infos) + detect_eight_bit_modules(infos)
        return {q.module: q for q in found}


def tensor_infos(tensors: Mapping[str, np.ndarray]) -> dict[str, TensorInfo]:
    """Header entries (`TensorInfo`, no file offsets) of in-memory tensors, for the detection."""
    infos = {}
    for name, array in tensors.items():
        tag = DTYPE_TAG.get(np.dtype(array.dtype), np.dtype(array.dtype).name)
        infos[name] = TensorInfo(name, tag, tuple(array.shape), 0, int(array.nbytes))
    return infos


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file of an export that must hold an object (config.json, the manifest, ...).

    Raises:
        ExportError: it cannot be read, is not JSON, or holds something else than an object.
    """
    content = read_json(path)
    if not isinstance(content, dict):
        raise ExportError(
            f"{path.name} of export {str(path.parent)!r} must be a JSON object, got "
            f"{type(content).__name__} {str(content)[:60]}"
        )
    return content


MANIFEST_FIELDS = {"spec": dict, "layout": str, "format": str, "recipes": dict, "w4a4": bool}
"""The manifest's fields that reading an export relies on, and their JSON types."""


def _manifest(path: Path) -> dict[str, Any]:
    manifest = read_json_object(path / PROVENANCE_FILE)
    for key, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            raise ExportError(
                f"{PROVENANCE_FILE} of export {str(path)!r} lacks {key!r} ({kind.__name__}); "
                f"not an export of nvfp4-export, or edited"
            )
    try:
        LlamaSpec(**manifest["spec"])
    except (TypeError, ExportError) as err:
        raise ExportError(f"{PROVENANCE_FILE} of export {str(path)!r}: bad spec: {err}") from None
    return manifest


def _weight_files(path: Path) -> list[str]:
    if (path / INDEX_FILE).is_file():
        weight_map = read_json_object(path / INDEX_FILE).get("weight_map")
        files = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
        if not all(isinstance(f, str) and f == Path(f).name for f in files):
            raise ExportError(
                f"{INDEX_FILE} of export {str(path)!r} must map tensor names to file names in "
                "the export directory"
            )
        return sorted(files)
    if (path / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise ExportError(f"{str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_export(path: str | Path) -> LoadedExport:
    """Reads an `nvfp4-export hf` directory.

    Raises:
        ExportError: a missing or unreadable file.
    """
    from nvfp4_format.safetensors_file import load_safetensors

    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"export directory {str(path)!r} does not exist")
    for name in (CONFIG_FILE, PROVENANCE_FILE):
        if not (path / name).is_file():
            raise ExportError(f"export directory {str(path)!r} lacks {name}")
    config, manifest = read_json_object(path / CONFIG_FILE), _manifest(path)
    hf_quant = path / HF_QUANT_CONFIG_FILE
    hf_quant_config = read_json_object(hf_quant) if hf_quant.is_file() else None
    tensors: dict[str, np.ndarray] = {}
    files = _weight_files(path)
    for file in files:
        try:
            part, _ = load_safetensors(path / file)
        except (OSError, ValueError) as err:
            raise ExportError(f"cannot read {str(path / file)!r}: {err}") from err
        tensors.update(part)
    return LoadedExport(path, config, manifest, hf_quant_config, tensors, tuple(files))


def linear_from_tensors(loaded: LoadedExport, name: str, source: str) -> ExportedLinear:
    """Rebuilds one `ExportedLinear` from the layout's tensors (found by `quantized_modules`).

    Raises:
        ExportError: the module's weight, block scales or global scale is missing.
    """
    t = loaded.tensors
    q = loaded.quantized_modules.get(name)
    if q is None:
        weight = LayoutNames.tensor(name, WEIGHT)
        if weight not in t:
            raise ExportError(f"export lacks the weight of {name!r}")
        return ExportedLinear(name, source, BF16, weight=t[weight])
    names, fmt = LAYOUT_NAMES[q.layout], FORMAT_OF_LAYOUT[q.layout]
    missing = [s for s, n in ((names.block_scales, q.block_scales),
                              (names.global_scale, q.global_scale)) if s and n is None]  # fmt: skip
    if missing:
        raise ExportError(f"export lacks {names.tensor(name, missing[0])!r}")
    packed, scales = t[q.packed], t.get(q.block_scales)
    base = ExportedLinear(name, source, fmt, packed=packed, scales=scales,
                          input_amax=_stored_amax(t, q.input_scale, names.scales_encode))  # fmt: skip
    if q.global_scale is None:
        return base
    if fmt == "fp8":
        stored = np.float32(np.asarray(t[q.global_scale]).reshape(()))
        amax = _fp8_amax(t, q.input_scale)
        return dataclasses.replace(base, stored_decode_scale=stored, input_amax=amax)
    stored = np.float32(t[q.global_scale].reshape(()))
    if names.scales_encode:
        return dataclasses.replace(base, weight_amax=_amax_from_encode(stored))
    return dataclasses.replace(
        base, weight_amax=_amax_from_encode(np.float32(1.0) / stored), stored_decode_scale=stored
    )


def _stored_amax(tensors: Mapping[str, np.ndarray], name: str | None, encode: bool):
    """The amax whose scale the stored scalar tensor `name` holds (an ENCODE scale when
    `encode`, else a DECODE scale); None without that tensor (weight-only, MXFP4)."""
    if name is None or np.asarray(tensors[name]).size != 1:
        return None  # a wrong shape is reported by the layout invariants
    stored = np.float32(np.asarray(tensors[name]).reshape(()))
    if not (np.isfinite(stored) and stored > 0):
        return None  # a zero or non-finite scale is reported by the layout invariants
    return float(_amax_from_encode(stored if encode else np.float32(1.0) / stored))


def _fp8_amax(tensors: Mapping[str, np.ndarray], name: str | None):
    """The amax whose FP8 decode scale (amax / 448) the stored scalar `name` holds, or None."""
    if name is None or np.asarray(tensors[name]).size != 1:
        return None
    stored = np.float32(np.asarray(tensors[name]).reshape(()))
    if not (np.isfinite(stored) and stored > 0):
        return None
    amax = np.float32(stored * np.float32(448))
    for candidate in (amax, np.nextafter(amax, np.inf), np.nextafter(amax, -np.inf)):
        if fp8_decode_scale(candidate) == stored:
            return float(candidate)
    return float(amax)


def _amax_from_encode(s_enc: np.float32) -> np.float32:
    """An amax whose `global_encode_scale` is `s_enc` (6 * 448 / s_enc, nudged to round-trip)."""
    import nvfp4_format

    amax = np.float32(np.float32(6 * 448) / s_enc)
    for candidate in (amax, np.nextafter(amax, np.inf), np.nextafter(amax, -np.inf)):
        if nvfp4_format.global_encode_scale(np.float32(candidate)) == s_enc:
            return np.float32(candidate)
    return amax


def _fused(modules: list[ExportedLinear], act_fmt: str, act_amax: float | None) -> ForwardLinear:
    """One training linear from its HF modules; an FP8 stand-in's input is served as FP8 with
    its static scale (`ForwardLinear.served_act_fmt`)."""
    w = np.concatenate([dequantize_linear(m) for m in modules], axis=0)
    served = "fp8" if modules[0].fmt == "fp8" and act_fmt != "none" else None
    return ForwardLinear(w, act_fmt, act_amax, served)


def _act_fmt(recipe: str, source: str) -> str:
    wf = weight_format(recipe, source)
    return wf.fmt if wf.quantized_input else "none"


def forward_weights(
    spec: LlamaSpec,
    linears: dict[str, list[ExportedLinear]],
    recipes: dict[str, str],
    dense: dict[str, np.ndarray],
) -> ForwardWeights:
    """`ForwardWeights` from exported linears (keyed by training path) and the dense tensors.

    `dense` holds float32 "embed" [V, D], "final_norm", "lm_head" [V, D] and the key
    "layers.{i}.{name}" of every per-layer entry of `dense_entries(spec)` (in HF's layout,
    `dense_names.stored_value`).
    """
    layers = [{} for _ in range(spec.num_layers)]
    for t in dense_entries(spec):
        if t.layer is not None:  # norms, biases, routers, the Mamba conv and SSM parameters
            layers[t.layer][t.key.split(".", 2)[2]] = dense[t.key]
    for i, layer in enumerate(layers):
        for kind in spec.block_linear_names(i):
            source = f"layers.{i}.{kind}"
            mods, act = linears[source], _act_fmt(recipes[source], source)
            key = kind.split(".", 1)[1].replace(".", "_")
            if is_expert_linear(source):
                per = len(mods) // spec.num_experts
                groups = [mods[k : k + per] for k in range(0, len(mods), per)]
                layer[key] = [_fused(g, act, g[0].input_amax) for g in groups]
            else:
                layer[key] = _fused(mods, act, mods[0].input_amax)
    return ForwardWeights(
        spec, dense[EMBED.key], dense[FINAL_NORM.key], dense[LM_HEAD.key], tuple(layers)
    )


def dense_layer_names(spec: LlamaSpec) -> list[str]:
    """The `ForwardWeights` layer keys of the spec's non-linear tensors (norms, biases)."""
    return [t.key for t in LAYER_TENSORS if spec.has(t)]


def _with_tied_head(spec: LlamaSpec, dense: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`dense` with its lm_head: the embedding itself when the spec ties them (no `LM_HEAD`)."""
    return dense if spec.has(LM_HEAD) else {**dense, LM_HEAD.key: dense[EMBED.key]}


def _from_hf(spec: LlamaSpec, t: DenseTensor, f32) -> np.ndarray:
    """Placed entry `t` as `ForwardWeights` holds it, read from the export by `f32(name)`
    (a fused linear's bias concatenated over its HF modules)."""
    if t.fused_linear is None:
        return f32(t.hf_name)
    return np.concatenate([f32(name) for name in dense_hf_names(spec, t)])


def weights_from_checkpoint(
    ckpt: Checkpoint, spec: LlamaSpec, recipes: dict[str, str], input_amax: dict[str, float]
) -> ForwardWeights:
    """The training model's forward weights (float32 norms, quantized linears as trained)."""
    p = ckpt.params
    linears = {
        path: export_linear(spec, path, p[f"{path}.kernel"], recipes[path], input_amax.get(path))
        for path in spec.linear_paths()
    }
    dense = {t.key: stored_value(t, p[t.param]) for t in dense_entries(spec)}
    return forward_weights(spec, linears, recipes, _with_tied_head(spec, dense))


def weights_from_export(loaded: LoadedExport) -> ForwardWeights:
    """The forward weights a loader of the export computes with (dequantized, BF16 dense tensors;
    static input amax from the exported input scale tensors, not from the manifest)."""
    spec, t = loaded.spec, loaded.tensors
    recipes = stored_recipes(loaded.layout, loaded.provenance["recipes"])

    def f32(name: str) -> np.ndarray:
        if name not in t:
            raise ExportError(f"export lacks tensor {name!r}")
        return np.asarray(t[name]).astype(np.float32)

    linears = {
        source: [linear_from_tensors(loaded, n, source) for n, _ in hf_modules(spec, source)]
        for source in spec.linear_paths()
    }
    dense = {entry.key: _from_hf(spec, entry, f32) for entry in dense_entries(spec)}
    return forward_weights(spec, linears, recipes, _with_tied_head(spec, dense))


def _bf16_round(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _is_linear(v) -> bool:
    return isinstance(v, (ForwardLinear, list))


def bf16_dense(w: ForwardWeights) -> ForwardWeights:
    """`w` with norms, biases, embedding and lm_head rounded to BF16, as the exports store them
    (the float32-stored Mamba conv and SSM parameters kept).

    The trained model's forward weights on the export's dense tensors: what an export's reload
    (or its ONNX file) computes with, next to its quantized linears.

    Example:
        >>> same = forward(bf16_dense(weights_from_checkpoint(ckpt, spec, recipes, {})), tokens)  # doctest: +SKIP
    """
    kept = {t.key.split(".", 2)[2] for t in dense_entries(w.spec) if t.dtype == "float32"}
    layers = tuple(
        {k: (v if _is_linear(v) or k in kept else _bf16_round(v)) for k, v in layer.items()}
        for layer in w.layers
    )
    return dataclasses.replace(
        w, embed_VxD=_bf16_round(w.embed_VxD), lm_head_VxD=_bf16_round(w.lm_head_VxD),
        final_norm=_bf16_round(w.final_norm), layers=layers,
    )  # fmt: skip


def _bf16_linear(v):
    """A `ForwardLinear` (or an expert list of them) with BF16-rounded weights; else `v`."""
    if isinstance(v, list):
        return [_bf16_linear(x) for x in v]
    if isinstance(v, ForwardLinear):
        return dataclasses.replace(v, w_OxI=_bf16_round(v.w_OxI))
    return v


def bf16_weights(w: ForwardWeights) -> ForwardWeights:
    """`w` with every linear's weight rounded to BF16: what compressed-tensors' CPU dequantization
    yields (transformers computes with these).

    Example:
        >>> hf_like = bf16_weights(weights_from_export(load_export("runs/tiny-ct")))  # doctest: +SKIP
    """
    layers = tuple({k: _bf16_linear(v) for k, v in layer.items()} for layer in w.layers)
    return dataclasses.replace(w, layers=layers)
