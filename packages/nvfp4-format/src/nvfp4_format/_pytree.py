"""Register containers as JAX pytrees when JAX is installed (JAX stays optional)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence


def register_dataclass(cls: type, data_fields: Sequence[str], meta_fields: Sequence[str]) -> type:
    """Register a dataclass with `jax.tree_util` if JAX is installed; return it unchanged.

    Array fields travel as pytree leaves (so the container crosses `jax.jit`, `vmap` and
    `custom_vjp` boundaries); shapes and block shapes are static metadata.
    """
    if importlib.util.find_spec("jax") is not None:
        import jax

        jax.tree_util.register_dataclass(
            cls, data_fields=list(data_fields), meta_fields=list(meta_fields)
        )
    return cls
