"""Test and task sessions for the nvfp4 monorepo.

Each package session installs ONLY that package and its declared dependencies into a fresh
virtualenv and runs its tests: that is what proves the packages compose. `nox` alone runs every
default session (the README's test command); `nox -s demo` runs the main job.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = [
    "lint",
    "format",
    "format_jax",
    "ops",
    "te_conformance",
    "train",
    "export",
    "integration",
]

FORMAT = "./packages/nvfp4-format"
OPS = "./packages/nvfp4-ops"
TRAIN = "./packages/nvfp4-train"
EXPORT = "./packages/nvfp4-export"
TORCH_CPU = "2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LOCAL_WHEELS = "/opt/wheels"


def _pytest(session: nox.Session, path: str) -> None:
    session.run("python", "-m", "pytest", "-q", path, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting check over the whole tree."""
    session.install("ruff==0.17.6")  # pinned: formatting rules change between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def format(session: nox.Session) -> None:  # noqa: A001 - the package is called format
    """nvfp4-format alone: NumPy and ml_dtypes only, no JAX."""
    session.install(f"{FORMAT}[test]")
    session.run("python", "-c", "import importlib.util as u; assert u.find_spec('jax') is None")
    _pytest(session, "packages/nvfp4-format/tests")


@nox.session
def format_jax(session: nox.Session) -> None:
    """nvfp4-format with JAX installed: the same tests plus the jit legs."""
    session.install(f"{FORMAT}[test,jax]")
    _pytest(session, "packages/nvfp4-format/tests")


@nox.session
def ops(session: nox.Session) -> None:
    """nvfp4-ops with its declared dependencies (nvfp4-format, jax)."""
    session.install(FORMAT, f"{OPS}[test]")
    _pytest(session, "packages/nvfp4-ops/tests")


@nox.session
def te_conformance(session: nox.Session) -> None:
    """nvfp4-ops against released TransformerEngine wheels (fetched now, never kept in the repo).

    For each pinned version (`nvfp4_ops.te_backend.TE_TESTED_VERSIONS`: the supported floor and
    the newest): bit-exactness against TE's PyTorch reference quantizer on CPU torch, every TE
    name/keyword te_backend uses checked in TE's JAX sources, and backend="te" run through TE's
    pure-JAX fallbacks. One pytest process per version (two releases never share one).
    """
    _install_cpu_torch(session)
    # pip downloads the wheels; TE imports pydantic (its recipes) and scipy (its RHT matrix)
    session.install(FORMAT, f"{OPS}[test]", "pip", "pydantic", "scipy")
    versions = session.run(
        "python", "-c",
        "from nvfp4_ops.te_backend import TE_TESTED_VERSIONS as v; print(' '.join(v))",
        silent=True,
    ).split()  # fmt: skip
    cache = Path(session.create_tmp()) / "transformer-engine"
    for version in versions:
        session.run(
            "python", "-m", "pytest", "-q", "packages/nvfp4-ops/conformance",
            f"--te-version={version}", f"--te-cache={cache}", *session.posargs,
        )  # fmt: skip


@nox.session
def train(session: nox.Session) -> None:
    """nvfp4-train with its declared dependencies."""
    session.install(FORMAT, OPS, f"{TRAIN}[test]")
    _pytest(session, "packages/nvfp4-train/tests")
    # the tests that train multi-block models in-process once more, every such model scanned
    # (`model.scan_layers: auto` from 2 blocks on); test_scan.py compares the two layouts
    scanned = ("test_step.py", "test_telemetry.py", "test_precision_schedule.py")
    session.run(
        "python", "-m", "pytest", "-q", "--scan-layers-from", "2",
        *(f"packages/nvfp4-train/tests/{name}" for name in scanned), *session.posargs,
    )  # fmt: skip


@nox.session
def export(session: nox.Session) -> None:
    """nvfp4-export with its declared dependencies (never nvfp4-train or nvfp4-ops)."""
    session.install(FORMAT, f"{EXPORT}[test]")
    _pytest(session, "packages/nvfp4-export/tests")


def _install_cpu_torch(session: nox.Session) -> None:
    """CPU-only torch for the transformers interop tests (a plain `torch` pulls a CUDA build).

    Machines of this project keep the CPU wheel in /opt/wheels; elsewhere PyTorch's CPU index has it.
    """
    if Path(LOCAL_WHEELS).is_dir():
        session.install("--find-links", LOCAL_WHEELS, f"torch=={TORCH_CPU}")
    else:
        session.install("--index-url", TORCH_CPU_INDEX, f"torch=={TORCH_CPU}")


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests: every package installed together, plus real clients of the exports."""
    _install_cpu_torch(session)
    session.install(
        f"{FORMAT}[test,jax]", f"{OPS}[test]", f"{TRAIN}[test]", f"{EXPORT}[test,verify]"
    )
    _pytest(session, "integration_tests")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a short NVFP4 pretraining run of the built-in tiny default."""
    session.install(FORMAT, OPS, TRAIN)
    session.run("nvfp4-train", "run", "examples/configs/tiny.yaml", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (not in the default test run): tables on stdout, JSON under docs/benchmarks/."""
    session.install(f"{FORMAT}[jax]", f"{OPS}[test]", TRAIN, EXPORT)
    session.run("python", "packages/nvfp4-format/benchmarks/bench_quantize.py")
    session.run("python", "packages/nvfp4-ops/benchmarks/bench_step.py")
    session.run("python", "packages/nvfp4-train/benchmarks/bench_train_step.py")
    session.run("python", "packages/nvfp4-export/benchmarks/bench_export.py")
