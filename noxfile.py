"""Test and task sessions for the nvfp4 monorepo.

Each package session installs ONLY that package and its declared dependencies into a fresh
virtualenv and runs its tests: that is what proves the packages compose. `nox` alone runs every
default session (the README's test command); `nox -s quick` lints and runs a fast subset for the
inner loop; `nox -s demo` runs the main job.
"""

from __future__ import annotations

import re
import tomllib
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
    "jax_floor",
]

FORMAT = "./packages/nvfp4-format"
OPS = "./packages/nvfp4-ops"
TRAIN = "./packages/nvfp4-train"
EXPORT = "./packages/nvfp4-export"
TORCH_CPU = "2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LOCAL_WHEELS = "/opt/wheels"


PARALLEL = ("--numprocesses=auto", "--maxprocesses=4", "--dist=loadfile", "--no-loadscope-reorder")
"""pytest-xdist: one worker per core (CI's machine has 2), at most 4; each test file runs whole
on one worker, so module-scoped fixtures (compiled steps, trained runs) are built once. Files are
handed out in collection order (not xdist's most-tests-first), which the test directories'
conftest.py puts longest first (`LONGEST_FIRST`), so that no long file starts last."""


def doctests(package: str) -> tuple[str, ...]:
    """pytest arguments that also run the docstring examples of the INSTALLED `package` (by
    import name: the sessions install packages, so collecting `src/` by path would import a
    second copy)."""
    return ("--doctest-modules", "--pyargs", package)


def _pytest(session: nox.Session, *paths: str, parallel: bool = True, dist: str = "") -> None:
    """pytest on `paths` (plus the session's posargs), on `PARALLEL` workers unless not
    `parallel`; `dist` replaces the distribution mode (e.g. "load": single tests, for one file)."""
    workers = (*PARALLEL, f"--dist={dist}") if dist else PARALLEL if parallel else ()
    session.run(
        "python", "-m", "pytest", "-q", *workers, *paths, *session.posargs,
        env=test_env(session),
    )  # fmt: skip


def test_env(session: nox.Session) -> dict[str, str | None]:
    """The environment of every test process: what makes the suite's many processes cheap.

    - JAX's persistent compilation cache, shared by every session and run (`.nox/.cache`). The
      suite compiles the same small programs many times: each `nvfp4-train run` subprocess, each
      resumed run and each test that rebuilds a train step compiles again, and on this CPU
      compiling is most of a test's time. The cache key hashes the lowered program, the compile
      options, the devices, the XLA flags and the jaxlib and backend versions, so a hit is the
      executable that would have been built: every result is the same, only the compile is
      skipped (`jax_floor`'s older jaxlib never shares an entry). Every program is cached.
    - Bytecode written: `PYTHONDONTWRITEBYTECODE` (set on this project's machines) is removed, so
      the first process to import jax, orbax or transformers leaves its `.pyc` in the session's
      virtualenv (uv installs none) and no later worker or `nvfp4-train run` process compiles
      the same sources again (`import nvfp4_train.training.run`: 9-10 s without them, 4.6-5 s with).
    """
    return {
        "JAX_COMPILATION_CACHE_DIR": str(Path(session.cache_dir) / "jax-compilation-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "PYTHONDONTWRITEBYTECODE": None,
    }


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
    _pytest(session, "packages/nvfp4-format/tests", *doctests("nvfp4_format"), parallel=False)


@nox.session
def format_jax(session: nox.Session) -> None:
    """nvfp4-format with JAX installed: the test files with JAX legs (jit and vmap byte parity
    with NumPy, the import cost). The NumPy-only files ran in `format` and are not run again:
    nothing in them changes with JAX installed (the array namespace is taken from the inputs,
    and the parity tests run the NumPy path in this JAX process beside the JAX one)."""
    session.install(f"{FORMAT}[test,jax]")
    _pytest(session, *(f"packages/nvfp4-format/tests/{name}" for name in FORMAT_JAX_TESTS))


FORMAT_JAX_TESTS = ("test_jax_parity.py", "test_outer_scale.py", "test_import_cost.py")
"""nvfp4-format's test files that import JAX (the others pass NumPy arrays only)."""


@nox.session
def ops(session: nox.Session) -> None:
    """nvfp4-ops with its declared dependencies (nvfp4-format, jax)."""
    session.install(FORMAT, f"{OPS}[test]")
    _pytest(session, "packages/nvfp4-ops/tests", *doctests("nvfp4_ops"))


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
    for version in versions:  # fetched before the workers start, so that none races another
        session.run(
            "python", "-c", "import sys, pathlib, te_standin; "
            "te_standin.fetch_release(sys.argv[1], pathlib.Path(sys.argv[2]))", version, str(cache),
            env={"PYTHONPATH": "packages/nvfp4-ops/conformance"},
        )  # fmt: skip
        session.run(
            "python", "-m", "pytest", "-q", *PARALLEL, "packages/nvfp4-ops/conformance",
            f"--te-version={version}", f"--te-cache={cache}", *session.posargs,
            env=test_env(session),
        )  # fmt: skip


@nox.session
def train(session: nox.Session) -> None:
    """nvfp4-train with its declared dependencies."""
    session.install(FORMAT, OPS, f"{TRAIN}[test]")
    _pytest(session, "packages/nvfp4-train/tests", *doctests("nvfp4_train"))
    # test_step.py trains 2-block models with every recipe, accumulation, loss scaling and
    # skipped steps: once more with every such model scanned (`model.scan_layers: auto` from 2
    # blocks on), less what test_scan.py shows scanned already (test_step.SCANNED_ELSEWHERE, each
    # skip saying where). Not re-run: test_telemetry.py (test_scan.py compares the probe rows,
    # which are the captured operands' statistics, and the amax of both layouts) and
    # test_precision_schedule.py (its runs have 1 block, which never scans; test_scan.py runs the
    # late BF16 forward on a stacked state).
    _pytest(session, "--scan-layers-from=2", "packages/nvfp4-train/tests/test_step.py", dist="load")


@nox.session
def export(session: nox.Session) -> None:
    """nvfp4-export with its declared dependencies (never nvfp4-train or nvfp4-ops)."""
    session.install(FORMAT, f"{EXPORT}[test]")
    _pytest(session, "packages/nvfp4-export/tests", *doctests("nvfp4_export"))


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
        f"{FORMAT}[test,jax]", f"{OPS}[test]", f"{TRAIN}[test,eval]", f"{EXPORT}[test,verify]"
    )
    session.install("accelerate>=0.26")  # lm-eval's own `hf` model (test_lm_eval_agreement.py)
    _pytest(session, "integration_tests")


def _jax_floor(package: str, extra: str | None = None) -> str:
    """X of the `jax>=X` a package declares (in its dependencies, or in one extra)."""
    project = tomllib.loads(Path(package, "pyproject.toml").read_text())["project"]
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
    floors = [m[1] for d in deps if (m := re.fullmatch(r"jax\s*>=\s*([0-9.]+)", d.strip()))]
    if len(floors) != 1:
        raise ValueError(f"{package} must declare exactly one 'jax>=X', found {deps}")
    return floors[0]


@nox.session
def jax_floor(session: nox.Session) -> None:
    """The oldest jax each package declares, installed exactly (jax and jaxlib pinned):
    nvfp4-format[jax] at its floor (its JAX path must stay byte-exact with NumPy: the parity
    tests), then nvfp4-ops and nvfp4-train at theirs (`jax.lax.scaled_dot`, the xla backend's
    probe and verification, the model)."""
    fmt = _jax_floor(FORMAT, "jax")
    session.install(f"{FORMAT}[test,jax]", f"jax=={fmt}", f"jaxlib=={fmt}")
    _pytest(session, "packages/nvfp4-format/tests/test_jax_parity.py", dist="load")
    ops, train = _jax_floor(OPS), _jax_floor(TRAIN)
    if ops != train:
        session.error(f"nvfp4-train's jax floor {train} differs from nvfp4-ops's {ops}")
    session.install(FORMAT, f"{OPS}[test]", f"{TRAIN}[test]", f"jax=={ops}", f"jaxlib=={ops}")
    ops_tests = ("test_forward.py", "test_backend_selection.py", "test_verify.py")
    # one process pair for both packages, spread test by test (test_model.py alone would hold
    # one worker for its whole 45 s); these files share no helper module names
    _pytest(
        session,
        *(f"packages/nvfp4-ops/tests/{name}" for name in ops_tests),
        "packages/nvfp4-train/tests/test_model.py",
        dist="load",
    )


QUICK = {
    "packages/nvfp4-format/tests": ("test_e2m1.py", "test_packing.py", "test_quantize.py",
                                    "test_swizzle.py", "test_errors.py", "test_mxfp4.py"),
    "packages/nvfp4-ops/tests": ("test_recipe.py", "test_hadamard.py", "test_forward.py",
                                 "test_backend_selection.py"),
    "packages/nvfp4-train/tests": ("test_layout.py", "test_config.py", "test_policy.py", "test_optim.py",
                                   "test_data_packing.py", "test_data_prepare.py",
                                   "test_memory.py", "test_flops.py",
                                   "test_model.py::test_gqa_attention_matches_reference_with_repeated_kv",
                                   "test_model.py::test_rope_matches_rotate_half_reference"),
    "packages/nvfp4-export/tests": ("test_formats.py", "test_dense_names.py", "test_linears.py",
                                    "test_servers.py", "test_serving_rules.py"),
    "integration_tests": ("test_policy_agreement.py", "test_code_size.py"),
}  # fmt: skip
"""`nox -s quick`: per package the tests of its core contracts that run in seconds."""


@nox.session
def quick(session: nox.Session) -> None:
    """Inner loop, a few minutes: lint, then a fast subset of every package's tests (`QUICK`),
    all packages in one virtualenv (no torch). Not part of the default run, which runs them all."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.install(f"{FORMAT}[test,jax]", f"{OPS}[test]", f"{TRAIN}[test]", f"{EXPORT}[test]")
    for directory, tests in QUICK.items():  # one pytest per directory: their helpers share names
        _pytest(session, *(f"{directory}/{t}" for t in tests))


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
    session.run("python", "packages/nvfp4-train/benchmarks/bench_attention.py")
    session.run("python", "packages/nvfp4-export/benchmarks/bench_export.py")
