"""precision.backend and precision.verify_backend: a backend that disagrees is not trained with."""

from __future__ import annotations

import io

import jax
import pytest

import nvfp4_ops
from nvfp4_train.backend_check import backend_line, trusted_backend
from nvfp4_train.checkpoint import Checkpoints
from nvfp4_train.config import ConfigError, config_from_dict
from nvfp4_train.errors import RunError
from nvfp4_train.policy import PrecisionConfig, backend_spec
from nvfp4_train.run import run

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
    assert trusted_backend(PrecisionConfig(), {"nvfp4"}, said.append) == "auto"
    assert said == []


def test_backend_line_names_what_runs_and_why_not_the_rest(monkeypatch):
    caps = {"emulated": (True, "pure JAX"), "xla": (True, "ok"), "te": (False, "no TE here")}
    monkeypatch.setattr(nvfp4_ops, "backend_capabilities", lambda: caps)
    monkeypatch.setattr(nvfp4_ops, "auto_order", lambda: ("te", "xla", "emulated"))
    assert backend_line("auto") == (
        "ops backend: precision.backend=auto -> xla, emulated (not here: te: no TE here)"
    )
    assert backend_line("xla") == "ops backend: precision.backend=xla -> xla"
    assert backend_line("te,emulated") == (
        "ops backend: precision.backend=te,emulated -> emulated (not here: te: no TE here)"
    )


def test_an_unavailable_named_backend_is_a_config_error():
    if CAPS["te"][0]:
        pytest.skip("TE runs here")
    with pytest.raises(ConfigError, match="precision.backend='te' is not available here"):
        trusted_backend(PrecisionConfig(backend="te"), {"nvfp4"}, print)


@needs_xla
def test_an_agreeing_backend_is_kept():
    said = []
    assert trusted_backend(PrecisionConfig(backend="xla"), {"nvfp4"}, said.append) == "xla"
    assert "backend 'xla' agrees with 'emulated' on 18 checks of nvfp4, nvfp4-no-sr" in said[0]


@needs_xla
def test_a_disagreeing_backend_is_not_used(broken_xla):
    said = []
    precision = PrecisionConfig(backend="xla,emulated")
    assert trusted_backend(precision, {"nvfp4", "bf16"}, said.append) == "emulated"
    text = "\n".join(said)
    assert "backend 'xla' DISAGREES with 'emulated'" in text
    assert "WARNING: backend(s) ['xla'] disagree" in text and "precision.backend='emulated'" in text
    with pytest.raises(RunError, match=r"\['xla'\] disagree with the emulated reference"):
        trusted_backend(PrecisionConfig(backend="xla", verify_backend="strict"), {"nvfp4"}, print)
    off = PrecisionConfig(backend="xla", verify_backend="off")
    assert trusted_backend(off, {"nvfp4"}, print) == "xla"


@needs_xla
def test_a_run_continues_on_the_verified_backend(broken_xla, tiny_config, tmp_path):
    cfg = config_from_dict(
        tiny_config(tmp_path / "run", precision={"recipe": "nvfp4", "backend": "xla"}),
        ["train.steps=2", "checkpoint.every_steps=2", "train.eval_every=0"],
    )
    out = io.StringIO()
    summary = run(cfg, stream=out)
    assert summary.final_step == 2
    assert "WARNING: backend(s) ['xla'] disagree" in out.getvalue()
    assert "backend: xla" in (tmp_path / "run" / "config.yaml").read_text()  # as configured
    with Checkpoints(tmp_path / "run" / "checkpoints", keep=3) as ckpts:
        assert ckpts.read_config(2)["precision"]["backend"] == "emulated"  # what trained
