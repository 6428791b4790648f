"""`verify`: reload an export, check that its files are the ones written and its invariants,
compare its logits with the trained model's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from nvfp4_export.checkpoint import Checkpoint, read_checkpoint, resolve_checkpoint
from nvfp4_export.clients import missing, onnxruntime_logits, transformers_logits
from nvfp4_export.errors import ExportError
from nvfp4_export.formats import (
    BF16,
    BF16_LAYOUT,
    COMPRESSED_TENSORS,
    FORMATS,
    MIXED,
    layout_names,
)
from nvfp4_export.forward import ForwardLinear, ForwardWeights, forward
from nvfp4_export.hf_files import dense_parts
from nvfp4_export.invariants import config_problems, layout_problems, nonfinite_problems
from nvfp4_export.linears import layout_linear
from nvfp4_export.manifest import STANDINS, sealing_problems
from nvfp4_export.model_spec import dense_entries, spec_from_config
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import (
    LoadedExport,
    bf16_dense,
    bf16_weights,
    linear_from_tensors,
    load_export,
    weights_from_checkpoint,
    weights_from_export,
)
from nvfp4_export.verify_scales import has_input_scales, input_scale_check

TRAINED_TOP1 = 0.9
"""Minimum top-1 agreement of the reload (activations as trained) with the trained model."""
TRAINED_MEAN_REL = 0.05
"""Maximum mean |diff| of that comparison, relative to the reference's mean |logit|."""
LOADER_REL = 1e-3
"""A real loader vs the NumPy forward on the same weights: max |diff| <= this * max |logit| + 1e-4."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Logits of `name` vs `against`: max / mean |diff|, top-1 agreement, pass (None:
    informational) and why it is informational when that needs saying (`note`)."""

    name: str
    against: str
    max_abs: float
    mean_abs: float
    top1: float
    passed: bool | None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Result of `verify`: broken invariants, logit comparisons, checks skipped (with reasons),
    and what could not be checked at all (`unchecked`: an export without file hashes, a
    checkpoint read without its integrity check or without a config checksum)."""

    path: Path
    problems: tuple[str, ...]
    comparisons: tuple[Comparison, ...]
    skipped: tuple[str, ...]
    unchecked: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No problem found (see `complete` for whether everything could be checked)."""
        return not self.problems and all(c.passed is not False for c in self.comparisons)

    @property
    def complete(self) -> bool:
        """Everything was checked: the files are the ones written, the checkpoint is the one
        saved."""
        return not self.unchecked


MOE_ROUTING_NOTE = (
    "informational for MoE: routing ties can flip which expert a token goes to between the two "
    "computations"
)
"""Why the emulation-vs-JAX comparison of an MoE run is not a pass/fail check."""


def compare(
    name: str, against: str, out: np.ndarray, ref: np.ndarray, mode: str, note: str = ""
) -> Comparison:
    """Compares logits; `mode` "trained", "loader" or "info" picks the pass criterion."""
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    top1 = float(np.mean(out.argmax(-1) == ref.argmax(-1)))
    max_abs, mean_abs = float(diff.max()), float(diff.mean())
    passed = None
    if mode == "trained":
        passed = top1 >= TRAINED_TOP1 and mean_abs <= TRAINED_MEAN_REL * float(np.abs(ref).mean())
    elif mode == "loader":
        passed = max_abs <= LOADER_REL * float(np.abs(ref).max()) + 1e-4
    return Comparison(name, against, max_abs, mean_abs, top1, passed, note)


def _bitexact_problems(loaded: LoadedExport, ckpt: Checkpoint) -> list[str]:
    """Re-quantizes every linear from the checkpoint (the bf16 layout: rounds its master to
    bfloat16) and compares the stored bytes."""
    spec, recipes, problems = loaded.spec, loaded.provenance["recipes"], []
    for source in spec.linear_paths():
        kernel = ckpt.params[f"{source}.kernel"]
        fresh = layout_linear(spec, source, kernel, recipes[source], None, loaded.layout)
        for m in fresh:
            stored = linear_from_tensors(loaded, m.name, source)
            for field in ("weight", "packed", "scales"):
                a, b = getattr(m, field), getattr(stored, field)
                if (a is None) != (b is None) or (
                    a is not None and a.tobytes() != np.asarray(b).tobytes()
                ):
                    problems.append(f"{m.name}.{field} differs from the checkpoint's quantization")
            has_global = m.fmt != BF16 and FORMATS[m.fmt].global_scale
            if has_global and not _same_global_scale(loaded, m):
                problems.append(f"{m.name}: global scale differs from the checkpoint's")
    return problems


def _same_global_scale(loaded: LoadedExport, fresh) -> bool:
    """The stored global scale equals the one re-derived from the checkpoint (bit for bit)."""
    names = layout_names(fresh.fmt, loaded.layout)
    stored = loaded.tensors[names.tensor(fresh.name, names.global_scale)]
    if names.scales_encode:
        return stored.reshape(()) == fresh.global_encode_scale
    return stored.reshape(()) == fresh.global_decode_scale


def _reference(ckpt: Checkpoint, weights: ForwardWeights, n: int, length: int):
    if ckpt.reference is not None:
        return ckpt.reference["tokens"], ckpt.reference["logits"], "JAX reference (checkpoint item)"
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, weights.spec.vocab_size, size=(n, length)).astype(np.int32)
    return tokens, forward(weights, tokens), "trained model (NumPy emulation; no reference item)"


def _hf_comparisons(loaded, tokens, ref, ref_name, skipped, problems) -> list[Comparison]:
    if loaded.layout not in (COMPRESSED_TENSORS, BF16_LAYOUT):
        skipped.append("transformers: the ModelOpt layout does not load in transformers on CPU")
        return []
    plain = loaded.layout == BF16_LAYOUT
    needed = ("torch", "transformers") + (() if plain else ("compressed_tensors",))
    absent = missing(*needed)
    if absent:
        what = "transformers" if plain else "transformers + compressed-tensors"
        skipped.append(f"{what}: not installed ({', '.join(absent)})")
        return []
    try:
        hf = transformers_logits(loaded.path, tokens)
    except Exception as err:  # noqa: BLE001 - a loader's failure is a finding, not a crash
        first = str(err).splitlines()[0][:300] if str(err) else ""
        problems.append(f"transformers does not load the export: {type(err).__name__}: {first}")
        return []
    expected = forward(
        bf16_weights(weights_from_export(loaded)),
        tokens,
        activations="none",
        compute_dtype="float32",
    )
    name = "transformers (BF16)" if plain else "transformers+compressed-tensors"
    mixed = loaded.provenance["format"] == MIXED
    if (loaded.spec.num_experts or mixed) and not plain:  # clients: CT dequantizes (own copy)
        name = "transformers on compressed-tensors' dequantization"
    out = [compare(name, "NumPy forward, same weights (fp32)", hf, expected, "loader")]
    if ref is not None:
        out.append(compare(name, ref_name, hf, ref, "info"))
    return out


def _trained_comparisons(loaded, weights, trained, tokens, ref, ref_name, ckpt) -> list[Comparison]:
    """The export's forward vs the trained model's (see docs/export.md, "verify"); a bf16 export
    (its masters unquantized, bit-exact against the checkpoint's) only informationally."""
    out = []
    if ckpt.reference is not None:
        out.append(_emulation_comparison(forward(trained, tokens), ref, ref_name, trained.spec))
    if loaded.layout == BF16_LAYOUT:
        unquantized = forward(weights, tokens)
        return out + [compare("export reload, BF16 masters", ref_name, unquantized, ref, "info")]
    reload = forward(weights, tokens)
    same_dense = forward(bf16_dense(trained), tokens)
    standins = loaded.provenance.get(STANDINS) or {}
    mode, note = ("info", STANDIN_NOTE.format(len(standins))) if standins else ("loader", "")
    out.append(
        compare(
            "export reload, activations as trained",
            "trained model with the export's BF16 norms",
            reload,
            same_dense,
            mode,
            note,
        )
    )
    out.append(compare("export reload, activations as trained", ref_name, reload, ref, "info"))
    if has_input_scales(loaded) and _all_input_amax(weights):
        static = forward(weights, tokens, activations="static")  # amax from the scale tensors
        name = "export reload, W4A4 with the input scale tensors of the files"
        out.append(compare(name, ref_name, static, ref, "info"))
    weight_only = forward(weights, tokens, activations="none")
    out.append(compare("export reload, weight-only", ref_name, weight_only, ref, "info"))
    return out


STANDIN_NOTE = (
    "the added error of {} MXFP8 linear(s) stored as FP8 per tensor (ModelOpt has no MXFP8 its "
    "readers load); their weights are checked bit for bit against the stand-in instead"
)
"""Why the tight reload check of an export with FP8 stand-ins is informational."""
EMULATION = "NumPy emulation of the trained model"
"""The run's own weights, quantized as in training, through the NumPy forward (not the export)."""


def _emulation_comparison(emulated, ref, ref_name: str, spec) -> Comparison:
    """The run's NumPy emulation vs its JAX forward (the reference item's logits): a check of
    the emulation for dense models, informational for MoE (`MOE_ROUTING_NOTE`)."""
    against = f"{ref_name}: logits of the run's JAX forward"
    if spec.num_experts:
        return compare(EMULATION, against, emulated, ref, "info", MOE_ROUTING_NOTE)
    return compare(EMULATION, against, emulated, ref, "trained")


def _all_input_amax(weights: ForwardWeights) -> bool:
    """Every linear of `weights` whose served input takes a calibrated scale (NVFP4, FP8) has
    a static input amax (a usable scale tensor)."""
    linears = [x for layer in weights.layers for v in layer.values()
               for x in (v if isinstance(v, list) else [v]) if isinstance(x, ForwardLinear)]  # fmt: skip
    served = [x for x in linears if x.act_fmt != "none"]
    return all(x.act_amax is not None for x in served
               if FORMATS[x.served_act_fmt or x.act_fmt].calibrated_input)  # fmt: skip


def _dense_problems(loaded: LoadedExport, ckpt: Checkpoint) -> list[str]:
    """Embeddings, norms and lm_head of the export against the checkpoint's, bit for bit (one
    checkpoint tensor read at a time)."""
    problems = []
    parts = (dense_parts(loaded.spec, t, ckpt.params[t.param]) for t in dense_entries(loaded.spec))
    for name, want in (item for part in parts for item in part.items()):
        got = loaded.tensors.get(name)
        if got is None:
            continue  # reported by the layout invariants
        if got.shape != want.shape or got.tobytes() != want.tobytes():
            count = int((got != want).sum()) if got.shape == want.shape else got.size
            problems.append(f"{name} differs from the checkpoint's ({count} elements)")
    return problems


def spec_problems(exported, trained) -> list[str]:
    """The model spec of the export's manifest against the checkpoint's, field by field."""
    a, b = dataclasses.asdict(exported), dataclasses.asdict(trained)
    return [
        f"the export's model has {key}={a[key]!r}, the checkpoint's {b[key]!r}"
        for key in a
        if a[key] != b[key]
    ]


def _against(loaded, weights, against: Path, n: int, integrity_check: bool, skipped: list):
    """(problems, comparisons, unchecked, tokens, reference logits, reference name) of the export
    against the checkpoint it came from; what it could not compare is added to `skipped`."""
    where = resolve_checkpoint(against, loaded.provenance.get("step"))
    ckpt = read_checkpoint(where, integrity_check=integrity_check)
    spec = spec_from_config(ckpt.config, ckpt.params)
    problems = spec_problems(loaded.spec, spec)
    problems += _dense_problems(loaded, ckpt) + _bitexact_problems(loaded, ckpt)
    scale_problems, note = input_scale_check(loaded, ckpt.quant_stats or {})
    problems += scale_problems
    skipped += [note] if note else []
    trained = weights_from_checkpoint(ckpt, spec, loaded.provenance["recipes"], {})
    tokens, ref, ref_name = _reference(ckpt, trained, n, min(32, spec.max_seq_len))
    comparisons = _trained_comparisons(loaded, weights, trained, tokens, ref, ref_name, ckpt)
    if has_input_scales(loaded) and not _all_input_amax(weights):
        skipped.append(
            "W4A4 with the input scale tensors: one is missing or not a positive number (above)"
        )
    return problems, comparisons, list(ckpt.notes), tokens, ref, ref_name


def verify_dir(
    path: Path, against: Path | None, n: int, integrity_check: bool = True
) -> VerifyReport:
    loaded = load_export(path)
    problems, unchecked = sealing_problems(path, loaded.provenance)
    problems += layout_problems(loaded)
    skipped, comparisons = [], []
    if nonfinite_problems(loaded):
        skipped.append("logit comparisons: the export holds NaN or Inf (see the problems)")
        return VerifyReport(path, tuple(problems), (), tuple(skipped), tuple(unchecked))
    weights = weights_from_export(loaded)
    tokens, ref, ref_name = None, None, None
    if against is not None:
        found, comparisons, notes, tokens, ref, ref_name = _against(
            loaded, weights, against, n, integrity_check, skipped
        )
        problems, unchecked = problems + found, unchecked + notes
    else:
        skipped.append("trained-model comparison: no --against run given")
        problems += input_scale_check(loaded, None)[0]
        tokens = np.random.default_rng(0).integers(
            0, loaded.spec.vocab_size, size=(n, min(32, loaded.spec.max_seq_len))
        )
    if config_problems(loaded):
        skipped.append("transformers: config.json disagrees with the exported model (see above)")
    else:
        comparisons += _hf_comparisons(loaded, tokens, ref, ref_name, skipped, problems)
    return VerifyReport(path, tuple(problems), tuple(comparisons), tuple(skipped), tuple(unchecked))


def verify_onnx(
    path: Path, against: Path | None, n: int, integrity_check: bool = True
) -> VerifyReport:
    if against is None:
        raise ExportError(
            "verifying an .onnx file needs --against RUN_DIR (the weights to compare with)"
        )
    absent = missing("onnx", "onnxruntime")
    if absent:
        return VerifyReport(path, (), (), (f"onnxruntime: not installed ({', '.join(absent)})",))
    ckpt = read_checkpoint(resolve_checkpoint(against), integrity_check=integrity_check)
    spec = spec_from_config(ckpt.config, ckpt.params)
    recipes = linear_recipes(spec, ckpt.config, ckpt.quant_stats)
    trained = weights_from_checkpoint(ckpt, spec, recipes, {})
    tokens, ref, ref_name = _reference(ckpt, trained, n, min(32, spec.max_seq_len))
    got = onnxruntime_logits(path, tokens)
    bf16_norms = bf16_dense(trained)
    expected = forward(bf16_norms, tokens, activations="none", compute_dtype="float32")
    comparisons = (
        compare("onnxruntime (CPU)", "NumPy forward, same weights (fp32)", got, expected, "loader"),
        compare("onnxruntime (CPU)", ref_name, got, ref, "info"),
    )
    return VerifyReport(path, (), comparisons, (), ckpt.notes)


def verify(
    path: str | Path,
    *,
    against: str | Path | None = None,
    sequences: int = 4,
    integrity_check: bool = True,
) -> VerifyReport:
    """Checks an export directory or .onnx file; compares with the run `against` when given.

    Args:
        path: an export directory or .onnx file.
        against: the run (or checkpoint) it was exported from.
        sequences: random sequences compared when the checkpoint has no `reference` item.
        integrity_check: check `against`'s parameters and config against its `integrity` item
            (which must exist); False uses them as found, and the report says so.

    Raises:
        ExportError: the export cannot be read at all, or bad arguments.
    """
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise ExportError(f"--sequences must be an integer >= 1, got {sequences!r}")
    path = Path(path)
    against = None if against is None else Path(against)
    if path.suffix == ".onnx":
        return verify_onnx(path, against, sequences, integrity_check)
    return verify_dir(path, against, sequences, integrity_check)


def render(report: VerifyReport) -> str:
    """A text report: problems, a comparison table, skips and the verdict."""
    lines = [f"verify {report.path}"]
    lines += [f"  PROBLEM: {p}" for p in report.problems] or ["  layout invariants: ok"]
    for c in report.comparisons:
        verdict = {True: "ok", False: "FAIL", None: "info"}[c.passed]
        verdict += f": {c.note}" if c.note else ""
        lines.append(
            f"  {c.name} vs {c.against}: max |diff| {c.max_abs:.3g}, mean {c.mean_abs:.3g}, "
            f"top-1 agreement {c.top1:.1%} [{verdict}]"
        )
    lines += [f"  skipped: {s}" for s in report.skipped]
    lines += [f"  NOT CHECKED: {s}" for s in report.unchecked]
    if not report.ok:
        lines.append("  result: FAILED")
    elif report.unchecked:
        more = len(report.unchecked) - 1
        what = report.unchecked[0] + (f"; and {more} more above" if more else "")
        lines.append(f"  result: NO PROBLEM FOUND, NOT FULLY CHECKED ({what})")
    else:
        lines.append("  result: OK")
    return "\n".join(lines)
