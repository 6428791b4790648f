"""Register containers as JAX pytrees when JAX is in use, without importing JAX for NumPy users.

Importing JAX costs seconds, and tool authors install this package without it. So a container is
registered with `jax.tree_util` as soon as JAX is imported by someone: at declaration if JAX is
already loaded, otherwise the first time a function of this package sees a JAX array. A JAX program
that imports nvfp4_format BEFORE jax and passes a NumPy-built container straight into `jax.jit`
calls `register_jax_pytrees()` once (nvfp4-ops does this on import).

The two module-level collections mirror JAX's own global pytree registry; nothing else is global.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

_DECLARED: list[tuple[type, tuple[str, ...], tuple[str, ...]]] = []
_REGISTERED: set[type] = set()


def register_dataclass(cls: type, data_fields: Sequence[str], meta_fields: Sequence[str]) -> type:
    """Declare `cls` a pytree (array fields as leaves, the rest static); registered once JAX is in use.

    Array fields travel as pytree leaves (so the container crosses `jax.jit`, `vmap` and
    `custom_vjp` boundaries); shapes and block shapes are static metadata.
    """
    _DECLARED.append((cls, tuple(data_fields), tuple(meta_fields)))
    if "jax" in sys.modules:
        register_jax_pytrees()
    return cls


def register_jax_pytrees() -> None:
    """Register every declared container with `jax.tree_util` (idempotent; imports JAX)."""
    pending = [entry for entry in _DECLARED if entry[0] not in _REGISTERED]
    if not pending:
        return
    jax = importlib.import_module("jax")
    for cls, data_fields, meta_fields in pending:
        jax.tree_util.register_dataclass(
            cls, data_fields=list(data_fields), meta_fields=list(meta_fields)
        )
        _REGISTERED.add(cls)
