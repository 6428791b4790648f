"""Activation amax for W4A4 input scales: from training's `quant_stats`, or a calibration pass.

Calibration runs the NumPy forward (`forward.py`, activations quantized as in training) over N
sequences and records max |x| at each quantized linear's input. The sequences are, in order of
preference: `max_seq_len`-token windows of a user text file tokenized with the run's
tokenizer.json (`calibration_text`), else the checkpoint's `reference` tokens (held-out
validation sequences written by training). Fused linears share one input, so one amax each.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nvfp4_export.errors import ExportError
from nvfp4_export.forward import ForwardWeights, forward


def amax_from_stats(quant_stats: dict | None, paths: list[str]) -> dict[str, float]:
    """`quant_stats.activation_amax` restricted to `paths` (empty when absent); a routed
    experts' linear holds a list, one amax per expert (checked by `expert_scales`).

    Raises:
        ExportError: a listed amax that is not a finite number >= 0.
    """
    stats = (quant_stats or {}).get("activation_amax") or {}
    out = {}
    for path in paths:
        if path in stats and isinstance(stats[path], (list, tuple)):
            out[path] = list(stats[path])  # an expert linear's: `expert_scales` checks it
        elif path in stats:
            value = float(stats[path])
            if not np.isfinite(value) or value < 0:
                raise ExportError(
                    f"quant_stats.activation_amax[{path!r}] must be finite >= 0, got {value}"
                )
            out[path] = value
    return out


def read_text(text_file: Path) -> str:
    """A calibration text file's content.

    Raises:
        ExportError: it cannot be read, or it is not UTF-8 text (a binary file).
    """
    try:
        data = text_file.read_bytes()
    except OSError as err:
        raise ExportError(
            f"cannot read --calibration-text {str(text_file)!r}: {err.strerror or err}"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ExportError(
            f"--calibration-text {str(text_file)!r} is not UTF-8 text (byte {err.start} is "
            f"0x{data[err.start]:02x}); a binary file?"
        ) from None
    if "\x00" in text:
        raise ExportError(
            f"--calibration-text {str(text_file)!r} holds NUL bytes: a binary file, not text"
        )
    return text


def text_sequences(text_file: Path, tokenizer_dir: Path | None, n: int, length: int) -> np.ndarray:
    """int32 [n', length] windows (n' <= n) of `text_file` encoded with the run's tokenizer."""
    if tokenizer_dir is None:
        raise ExportError("--calibration-text needs the run's tokenizer/ directory; none found")
    import tokenizers

    text = read_text(text_file)
    try:
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    except Exception as err:  # tokenizers raises its own Exception type for a broken file
        raise ExportError(
            f"the run's tokenizer {str(tokenizer_dir / 'tokenizer.json')!r} does not load: {err}"
        ) from err
    ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
    count = min(n, ids.size // length)
    if count < 1:
        raise ExportError(
            f"calibration text {str(text_file)!r} has {ids.size} tokens, fewer than one "
            f"sequence of {length}"
        )
    return ids[: count * length].reshape(count, length)


def calibration_tokens(
    n: int, reference: dict | None, text_file: Path | None, tokenizer_dir: Path | None, length: int
) -> np.ndarray:
    """The N calibration sequences (see the module docstring for where they come from)."""
    if n < 1:
        raise ExportError(f"--calibrate must be >= 1 sequences, got {n}")
    if text_file is not None:
        return text_sequences(Path(text_file), tokenizer_dir, n, length)
    if reference is not None:
        return reference["tokens"][:n]
    raise ExportError(
        "--calibrate needs sequences: pass --calibration-text FILE (tokenized with the run's "
        "tokenizer) or export a checkpoint that holds the 'reference' item"
    )


def calibrate(weights: ForwardWeights, tokens_NxL: np.ndarray, batch: int = 4) -> dict[str, float]:
    """max |x| at each linear's input over `tokens_NxL`, running the model as trained."""
    amax: dict[str, float] = {}
    for start in range(0, tokens_NxL.shape[0], batch):
        forward(weights, tokens_NxL[start : start + batch], activations="dynamic", amax_out=amax)
    return amax
