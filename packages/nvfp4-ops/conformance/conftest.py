"""The conformance session: nvfp4-ops against one released TransformerEngine per pytest run.

`nox -s te_conformance` runs this directory once per version in `TE_TESTED_VERSIONS`
(`--te-version`); the wheel is downloaded at test time into `--te-cache` (nothing of TE is kept in
this repository). Each run imports one release only, so two releases never share a process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import te_standin

from nvfp4_ops.te_backend import TE_TESTED_VERSIONS


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--te-version",
        default=TE_TESTED_VERSIONS[-1],
        help=f"the transformer-engine release to check against (pinned: {TE_TESTED_VERSIONS})",
    )
    parser.addoption(
        "--te-cache",
        default=str(Path(__file__).resolve().parents[3] / ".cache" / "transformer-engine"),
        help="where downloaded and unpacked wheels are kept between runs",
    )


@pytest.fixture(scope="session")
def te_version(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--te-version")


@pytest.fixture(scope="session")
def te_root(request: pytest.FixtureRequest, te_version: str) -> Path:
    """The unpacked wheel of the release under test."""
    cache = Path(request.config.getoption("--te-cache"))
    return te_standin.fetch_release(te_version, cache)


@pytest.fixture(scope="session")
def reference(te_root: Path, te_version: str):
    """TE's NVFP4 reference module (NVFP4QuantizerRef and its helpers)."""
    return te_standin.import_reference(te_root, te_version)


@pytest.fixture(scope="session")
def te_jax(te_root: Path, te_version: str):
    """transformer_engine.jax of the release, over the CPU stand-in of its extension."""
    return te_standin.import_te_jax(te_root, te_version)
