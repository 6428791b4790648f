"""precision.backend and precision.verify_backend: a backend that disagrees, or crashes while it
is checked, is not trained with; the `ops backend:` line names it and why."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import jax
import pytest

import nvfp4_ops
from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.errors import RunError
from nvfp4_train.precision.backend_check import (
    BackendChoice,
    backend_line,
    te_context,
    trusted_backend,
)
from nvfp4_train.precision.policy import PrecisionConfig, backend_spec
from nvfp4_train.training.run import run

CAPS = nvfp4_ops.backend_capabilities()
needs_xla = pytest.mark.skipif(not CAPS["xla"][0], reason=CAPS["xla"][1])


@pytest.fixture
def broken_xla(monkeypatch):
    """The xla backend's GEMM made 10% too large: every check of it must fail."""
    gemm = nvfp4_ops.gemm.GEMMS["xla"]
    monkeypatch.setitem(
        nvfp4_ops.gemm.GEMMS, "xla", lambda *args, **kwargs: gemm(*args, **kwargs) * 1.1
    )
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_backend_values_are_parsed_and_checked():
    assert backend_spec("xla,emulated") == ("xla", "emulated")
    for bad in ("cuda", "te,te", "", "te,"):
        with pytest.raises(ConfigError, match="precision.backend must be 'auto', one of"):
            config_from_dict({"precision": {"backend": bad}})
    with pytest.raises(ConfigError, match="precision.verify_backend must be one of"):
        config_from_dict({"precision": {"verify_backend": "loud"}})


def test_auto_on_cpu_has_nothing_to_verify():
    said = []
    if jax.default_backend() != "cpu" or CAPS["te"][0]:
        pytest.skip("a host with another backend than emulated for auto")
    assert trusted_backend(PrecisionConfig(), {"nvfp4"}, said.append) == BackendChoice("auto")
    assert said == []


@pytest.fixture
def gpu_host(monkeypatch):
    """A host with xla available (and TE as given), auto's GPU order, nothing verified yet."""

    def set_host(te: bool = False) -> None:
        caps = {"emulated": (True, "pure JAX"), "xla": (True, "ok"), "te": (te, "no TE here")}
        monkeypatch.setattr(nvfp4_ops, "backend_capability", caps.__getitem__)
        monkeypatch.setattr(nvfp4_ops, "auto_order", lambda: ("te", "xla", "emulated"))

    return set_host


def test_backend_line_names_what_runs_and_why_not_the_rest(gpu_host):
    gpu_host()
    assert backend_line("auto") == (
        "ops backend: precision.backend=auto -> xla, emulated (not here: te: no TE here)"
    )
    assert backend_line("xla") == "ops backend: precision.backend=xla -> xla"
    assert backend_line("te,emulated") == (
        "ops backend: precision.backend=te,emulated -> emulated (not here: te: no TE here)"
    )
    assert backend_line("auto", {"xla": "crashed while verified: RuntimeError: boom"}) == (
        "ops backend: precision.backend=auto -> emulated (not here: te: no TE here) "
        "(not used: xla: crashed while verified: RuntimeError: boom)"
    )


def test_off_with_auto_keeps_the_native_backends_unverified(gpu_host):
    # "auto" inside nvfp4_ops takes only verified backends; "off" means "use them unchecked",
    # so the run passes the explicit order instead.
    gpu_host()
    off = PrecisionConfig(verify_backend="off")
    assert trusted_backend(off, {"nvfp4"}, print) == BackendChoice("te,xla,emulated")


def test_an_unavailable_named_backend_is_a_config_error():
    if CAPS["te"][0]:
        pytest.skip("TE runs here")
    with pytest.raises(ConfigError, match="precision.backend='te' is not available here"):
        trusted_backend(PrecisionConfig(backend="te"), {"nvfp4"}, print)


@needs_xla
def test_an_agreeing_backend_is_kept():
    said = []
    choice = trusted_backend(PrecisionConfig(backend="xla"), {"nvfp4"}, said.append)
    assert choice == BackendChoice("xla")
    # 24 checks: 4 cases (aligned, unaligned, batched, grouped ragged_dot) x 2 recipes x y, dX, dW
    assert "backend 'xla' agrees with 'emulated' on 24 checks of nvfp4, nvfp4-no-sr" in said[0]
    assert nvfp4_ops.verification("xla")[0]  # recorded: "auto" in the model may now use it


@needs_xla
def test_a_disagreeing_backend_is_not_used(broken_xla):
    said = []
    precision = PrecisionConfig(backend="xla,emulated")
    choice = trusted_backend(precision, {"nvfp4", "bf16"}, said.append)
    assert choice.backend == "emulated" and "disagrees with 'emulated'" in choice.dropped["xla"]
    text = "\n".join(said)
    assert "backend 'xla' DISAGREES with 'emulated'" in text
    assert "WARNING: backend(s) ['xla'] failed the check" in text
    assert "precision.backend='emulated'" in text
    with pytest.raises(RunError, match=r"\['xla'\] failed the check against the emulated"):
        trusted_backend(PrecisionConfig(backend="xla", verify_backend="strict"), {"nvfp4"}, print)
    off = PrecisionConfig(backend="xla", verify_backend="off")
    assert trusted_backend(off, {"nvfp4"}, print) == BackendChoice("xla")


@needs_xla
def test_a_backend_that_crashes_while_checked_is_dropped_and_named(monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED (fake)\n<pages of HLO>")

    monkeypatch.setitem(nvfp4_ops.gemm.GEMMS, "xla", crash)
    monkeypatch.setattr(nvfp4_ops.backends, "_VERIFIED", {})  # this test's failure stays here
    jax.clear_caches()
    said = []
    choice = trusted_backend(PrecisionConfig(backend="xla,emulated"), {"nvfp4"}, said.append)
    reason = (
        "crashed while verified: RuntimeError: CUDNN_STATUS_NOT_SUPPORTED (fake) (in aligned nvfp4)"
    )
    assert choice == BackendChoice("emulated", {"xla": reason})
    assert "backend 'xla' CRASHED while checked against 'emulated'" in said[0]
    assert backend_line("xla,emulated", choice.dropped).endswith(f"(not used: xla: {reason})")
    strict = PrecisionConfig(backend="xla", verify_backend="strict")
    with pytest.raises(RunError, match=r"\['xla'\] failed .*xla: crashed while verified: Runtime"):
        trusted_backend(strict, {"nvfp4"}, print)
    jax.clear_caches()


def test_te_context_sets_te_mesh_resource_only_where_te_may_run_sharded(gpu_host, monkeypatch):
    entered = []
    monkeypatch.setattr(nvfp4_ops, "te_sharding", lambda mesh, **axes: entered.append(axes))
    mesh8, mesh1 = SimpleNamespace(size=8, shape={"data": 8}), SimpleNamespace(size=1, shape={})
    axes = {"data": "data", "fsdp": "fsdp"}
    gpu_host(te=False)
    assert isinstance(te_context("te", mesh8, **axes), contextlib.nullcontext)  # TE not here
    gpu_host(te=True)
    assert isinstance(te_context("xla", mesh8, **axes), contextlib.nullcontext)
    assert isinstance(te_context("te", mesh1, **axes), contextlib.nullcontext)
    te_context("te,xla", mesh8, **axes)
    assert entered == [axes]
    # fused attention "te" needs TE's mesh context on several devices whatever runs the GEMMs
    # (without it TE partitions attention for a context-parallel axis named "")
    gpu_host(te=False)
    te_context("emulated", mesh8, **axes, attention="te")
    assert entered == [axes, axes]
    assert isinstance(te_context("auto", mesh1, **axes, attention="te"), contextlib.nullcontext)
    assert isinstance(te_context("auto", mesh8, **axes, attention="cudnn"), contextlib.nullcontext)


@needs_xla
def test_a_run_continues_on_the_verified_backend(broken_xla, tiny_config, tmp_path):
    cfg = config_from_dict(
        tiny_config(tmp_path / "run", precision={"recipe": "nvfp4", "backend": "xla"}),
        ["train.steps=2", "checkpoint.every_steps=2", "train.eval_every=0"],
    )
    out = io.StringIO()
    summary = run(cfg, stream=out)
    assert summary.final_step == 2
    assert "WARNING: backend(s) ['xla'] failed the check" in out.getvalue()
    assert "(not used: xla: disagrees with 'emulated'" in out.getvalue()
    assert "backend: xla" in (tmp_path / "run" / "config.yaml").read_text()  # as configured
    with Checkpoints(tmp_path / "run" / "checkpoints", keep=3) as ckpts:
        assert ckpts.read_config(2)["precision"]["backend"] == "emulated"  # what trained
