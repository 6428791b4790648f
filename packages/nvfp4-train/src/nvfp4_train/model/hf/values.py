"""Values read from a Hugging Face `config.json`, checked: whole numbers and floats as
transformers writes them (including its `{"__float__": "Infinity"}` for a float JSON cannot
hold).

Example:
    >>> whole_number({"hidden_size": 64.0}, "hidden_size")
    64
    >>> json_float({"__float__": "Infinity"}, "time_step_limit")
    inf
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

from nvfp4_train.model.hf.errors import HFConfigError


def whole_number(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """config.json's `key` as an int: a whole number (2, or 2.0), never a truncated 2.5, a
    boolean or a null; a missing `key` (or a null optional one) is `default`, a missing required
    one a KeyError."""
    if key not in hf:
        if default is None:
            raise KeyError(key)
        return default
    value = hf[key]
    if value is None and default is not None:
        return default
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise HFConfigError(f"model.init_from: config.json's {key} must be a whole number, "
                            f"got {value!r}")  # fmt: skip
    return int(value)


def json_float(value: Any, key: str) -> float:
    """A float of config.json's `key`: a number, `Infinity` (Python's JSON reads it), or the
    `{"__float__": "Infinity"}` transformers 5 writes for a non-finite float.

    Raises:
        HFConfigError: anything else (naming `key` and the value), or NaN.
    """
    number = (
        value["__float__"] if isinstance(value, Mapping) and set(value) == {"__float__"} else value
    )
    if isinstance(number, str):
        with contextlib.suppress(ValueError):
            number = float(number)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or math.isnan(number):
        raise HFConfigError(
            f"model.init_from: config.json's {key} must hold numbers, got {value!r}"
        )
    return float(number)
