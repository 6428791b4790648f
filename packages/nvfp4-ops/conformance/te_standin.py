"""Fetch a released TransformerEngine and import the parts of it that run without CUDA.

Nothing of TransformerEngine is copied into this repository: `fetch_release` downloads the
pure-Python `transformer-engine` wheel of a pinned version from the package index
(`pip download --no-deps`) into a cache directory and unpacks it.

TE's Python packages import its compiled extensions (`transformer_engine_torch`,
`transformer_engine_jax`, `libtransformer_engine.so`) at import time. The stand-ins below replace
only that, and are kept as small as the imports allow:

- `import_reference`: TE's pure-PyTorch NVFP4 reference quantizer
  (`pytorch/custom_recipes/reference_nvfp4.py`; `quantization_nvfp4.py` in 2.14,
  `quantization_ref_nvfp4.py` in 2.16-2.18). Its own modules are loaded from the wheel; only
  `transformer_engine.pytorch.quantized_tensor` (the `Quantizer` / `QuantizedTensorStorage` base
  classes: usage flags and nothing else) and `transformer_engine.pytorch.tensor.utils.is_custom`
  are stand-ins, because the real ones import the compiled extension.
- `import_te_jax`: TE's JAX package with `transformer_engine_jax` replaced by a module that
  has the enum types and the few functions TE calls at import time, and no kernels. Every
  primitive then has to take TE's own pure-JAX fallback (`NVTE_JAX_CUSTOM_CALLS=false`, set by
  `pure_jax_te`). jax < 0.11 has no CPU lowering for `jax.nn.scaled_matmul`, which TE's fallback
  GEMM calls; `pure_jax_te` registers one (the same `lax.scaled_dot` decomposition jax registers
  for ROCm).
- `pure_jax_te` also works around two bugs in TE's pure-JAX NVFP4 quantizer
  (jax/quantize/quantizer.py, `NVFP4Quantizer._quantize_func`, 2.10 to 2.20), which TE's CUDA
  kernels do not go through:
  1. it re-rounds the already E4M3-cast block scales with `lax.reduce_precision(x, 4, 3)`, which
     has IEEE semantics (largest finite value 240), so every block scale above 240 becomes NaN.
     For float8_e4m3fn input that call is meant to be the identity; the patch makes it so.
  2. it broadcasts the 16x16 tile scales to one scale per row with `jnp.tile`, which repeats the
     whole [rows/16, cols/16] array 16 times instead of each tile row 16 times, so row r gets the
     scale of tile row r % (rows/16) instead of r // 16 (the codes are right, the scales are not).
     The patch gives that module a `jnp` whose `tile` repeats elements (`jnp.tile` is used there
     for this broadcast only).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

REFERENCE_MODULES = ("reference_nvfp4", "quantization_ref_nvfp4", "quantization_nvfp4")
"""Where each TE release keeps NVFP4QuantizerRef (newest name first)."""


def fetch_release(version: str, cache: Path) -> Path:
    """The unpacked `transformer-engine==version` wheel (a directory holding `transformer_engine/`)."""
    root = cache / f"transformer_engine-{version}"
    if (root / "transformer_engine").is_dir():
        return root
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(wheels.glob(f"transformer_engine-{version}-*.whl"), None)
    if wheel is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--dest", str(wheels), f"transformer-engine=={version}"],
            check=True,
        )  # fmt: skip
        wheel = next(wheels.glob(f"transformer_engine-{version}-*.whl"))
    tmp = root.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp)
    tmp.rename(root)
    return root


def _package(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module
    return module


def _install_core(root: Path, version: str) -> None:
    """`transformer_engine` (bare package) and `transformer_engine.common` (real, no libraries)."""
    if "transformer_engine.common" in sys.modules:
        return
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    te = _package("transformer_engine", root / "transformer_engine")
    te.__version__ = version
    os.environ["NVTE_PROJECT_BUILDING"] = "1"  # common/__init__.py then loads no CUDA library
    try:
        common = importlib.import_module("transformer_engine.common")
    finally:
        del os.environ["NVTE_PROJECT_BUILDING"]
    common.load_framework_extension = lambda framework: None


class _Quantizer:
    """Stand-in for transformer_engine.pytorch.quantized_tensor.Quantizer (usage flags only)."""

    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False


class _QuantizedTensorStorage:
    """Stand-in for transformer_engine.pytorch.quantized_tensor.QuantizedTensorStorage."""


def import_reference(root: Path, version: str) -> types.ModuleType:
    """TE's NVFP4 reference module of the release unpacked at `root` (has `NVFP4QuantizerRef`)."""
    _install_core(root, version)
    pytorch = root / "transformer_engine" / "pytorch"
    if "transformer_engine.pytorch" not in sys.modules:
        _package("transformer_engine.pytorch", pytorch)
        _package("transformer_engine.pytorch.tensor", pytorch / "tensor")
        quantized = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
        quantized.Quantizer = _Quantizer
        quantized.QuantizedTensorStorage = _QuantizedTensorStorage
        sys.modules[quantized.__name__] = quantized
        utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
        utils.is_custom = lambda x=None: bool(getattr(x, "custom", False))
        sys.modules[utils.__name__] = utils
    for name in REFERENCE_MODULES:
        if (pytorch / "custom_recipes" / f"{name}.py").is_file():
            return importlib.import_module(f"transformer_engine.pytorch.custom_recipes.{name}")
    raise FileNotFoundError(f"no NVFP4 reference quantizer in {pytorch / 'custom_recipes'}")


class _Member(int):
    """A member of a stand-in pybind11 enum: a distinct int with `.name` and `.value`."""

    def __new__(cls, owner: str, name: str, value: int) -> _Member:
        member = int.__new__(cls, value)
        member.name, member.value, member.owner = name, value, owner
        return member

    def __repr__(self) -> str:
        return f"{self.owner}.{self.name}"

    __str__ = __repr__
    __hash__ = int.__hash__


class _EnumType(type):
    """A stand-in pybind11 enum type: each attribute read creates a new distinct member."""

    def __getattr__(cls, name: str) -> _Member:
        if name.startswith("__"):
            raise AttributeError(name)
        members = cls.__dict__["_members"]
        if name not in members:
            members[name] = _Member(cls.__name__, name, len(members))
        return members[name]

    def __iter__(cls) -> Iterator[_Member]:
        return iter(cls.__dict__["_members"].values())

    def __instancecheck__(cls, member: object) -> bool:
        return isinstance(member, _Member) and member.owner == cls.__name__


class _Extension(types.ModuleType):
    """Stand-in for `transformer_engine_jax`: enum types on demand, no kernels."""

    def __getattr__(self, name: str):
        if name.startswith("__") or not (name[0].isupper() or name.startswith(("NVTE", "JAXX"))):
            raise AttributeError(name)  # hasattr() probes for optional kernels must say no
        enum = _EnumType(name, (), {"_members": {}})
        setattr(self, name, enum)
        return enum


def _no_kernel(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{name} needs TE's compiled extension (CPU stand-in)")

    return call


def _fused_attn_backend(ext: types.ModuleType):
    def backend(*args):
        chosen = ext.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
        return (chosen, "") if len(args) == 1 else chosen  # 2.20 takes one params object

    return backend


def _qkv_format(ext: types.ModuleType):
    def qkv_format(layout: _Member) -> _Member:  # NVTE_THD_THD_THD -> NVTE_THD, NVTE_BS3HD -> ...
        name = layout.name.removeprefix("NVTE_")
        short = "THD" if name.startswith("T") else "SBHD" if name.startswith("SB") else "BSHD"
        return getattr(ext.NVTE_QKV_Format, f"NVTE_{short}")

    return qkv_format


def _extension() -> types.ModuleType:
    ext = _Extension("transformer_engine_jax")
    ext.registrations = dict
    ext.get_device_compute_capability = lambda gpu_id=0: 100
    ext.get_cudnn_version = lambda: 91200
    ext.get_cuda_version = lambda: 12090
    ext.get_cublasLt_version = lambda: 120900
    ext.get_num_compute_streams = lambda: 1
    ext.get_grouped_gemm_setup_workspace_size = lambda n: 0
    ext.nvte_built_with_cublasmp = lambda: False
    # fused attention: cuDNN's arbitrary-length backend for every shape, no workspace (the
    # kernel itself is te_attention_standin.py's CPU lowering)
    ext.get_fused_attn_backend = _fused_attn_backend(ext)
    workspace = lambda *args: ((0,), ext.DType.kByte)  # noqa: E731
    ext.get_fused_attn_fwd_workspace_sizes = ext.get_fused_attn_bwd_workspace_sizes = workspace
    ext.nvte_get_qkv_format = _qkv_format(ext)
    for name in ("get_cgemm_num_max_streams", "initialize_cgemm_communicator",
                 "is_collective_gemm_with_cublasmp"):  # fmt: skip
        setattr(ext, name, _no_kernel(name))
    return ext


def import_te_jax(root: Path, version: str) -> types.ModuleType:
    """`transformer_engine.jax` of the release at `root`, over the CPU stand-in extension."""
    _install_core(root, version)
    sys.modules.setdefault("transformer_engine_jax", _extension())
    return importlib.import_module("transformer_engine.jax")


def _register_cpu_scaled_matmul() -> None:
    import jax
    from jax._src.cudnn import scaled_matmul_stablehlo
    from jax._src.interpreters import mlir

    def lowering(ctx, a, b, a_scale, b_scale, preferred_element_type):
        def decomposed(lhs, rhs, lhs_scale, rhs_scale):
            return jax.lax.scaled_dot(
                lhs, rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale,
                dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                preferred_element_type=preferred_element_type,
            )  # fmt: skip

        return mlir.lower_fun(decomposed, multiple_results=False)(ctx, a, b, a_scale, b_scale)

    primitive = scaled_matmul_stablehlo._scaled_matmul_p
    mlir.register_lowering(primitive, lowering, platform="cpu")


class _RepeatingTile:
    """`jax.numpy`, except that `tile(x, reps)` repeats each element `reps[i]` times on axis i."""

    def __init__(self, jnp) -> None:
        self._jnp = jnp

    def __getattr__(self, name: str):
        return getattr(self._jnp, name)

    def tile(self, x, reps):
        for axis, rep in enumerate(reps):
            x = self._jnp.repeat(x, int(rep), axis=axis)
        return x


@contextlib.contextmanager
def pure_jax_te() -> Iterator[None]:
    """Trace TE calls inside this context: TE's pure-JAX fallbacks, runnable on CPU."""
    import jax
    import jax.numpy as jnp

    _register_cpu_scaled_matmul()
    reduce_precision = jax.lax.reduce_precision

    def patched(x, exponent_bits, mantissa_bits):
        if jnp.dtype(x.dtype) == jnp.float8_e4m3fn and (exponent_bits, mantissa_bits) == (4, 3):
            return x  # already E4M3FN; IEEE E4M3 rounding would turn 256..448 into NaN
        return reduce_precision(x, exponent_bits, mantissa_bits)

    quantizer = importlib.import_module("transformer_engine.jax.quantize.quantizer")
    saved = os.environ.get("NVTE_JAX_CUSTOM_CALLS")
    os.environ["NVTE_JAX_CUSTOM_CALLS"] = "false"
    jax.lax.reduce_precision = patched
    quantizer.jnp = _RepeatingTile(jnp)
    try:
        yield
    finally:
        quantizer.jnp = jnp
        jax.lax.reduce_precision = reduce_precision
        if saved is None:
            del os.environ["NVTE_JAX_CUSTOM_CALLS"]
        else:
            os.environ["NVTE_JAX_CUSTOM_CALLS"] = saved
