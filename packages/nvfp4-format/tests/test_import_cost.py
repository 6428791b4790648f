"""Importing nvfp4_format never imports JAX; JAX arrays register the containers on first use."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_import_does_not_load_jax():
    assert _run("import sys, nvfp4_format; print('jax' in sys.modules)") == "False"


def test_containers_cross_jit_after_import_order_format_then_jax():
    pytest.importorskip("jax")
    code = (
        "import numpy as np, nvfp4_format as nf, jax, jax.numpy as jnp\n"
        "q = jax.jit(nf.quantize)(jnp.ones((2, 16)))\n"  # a JAX array registers the pytrees
        "print(type(q).__name__, jax.jit(nf.dequantize)(nf.quantize(np.ones((2, 16), np.float32))).shape)"
    )
    assert _run(code) == "NVFP4Array (2, 16)"


def test_explicit_registration_for_numpy_built_containers():
    pytest.importorskip("jax")
    code = (
        "import numpy as np, nvfp4_format as nf, jax\n"
        "q = nf.quantize(np.ones((2, 16), np.float32))\n"
        "nf.register_jax_pytrees()\n"
        "print(jax.jit(nf.dequantize)(q).shape)"
    )
    assert _run(code) == "(2, 16)"


def test_registered_at_import_when_jax_is_already_loaded():
    pytest.importorskip("jax")
    code = (
        "import jax, numpy as np, nvfp4_format as nf\n"
        "print(len(jax.tree_util.tree_leaves(nf.quantize(np.ones((2, 16), np.float32)))))"
    )
    assert _run(code) == "3"
