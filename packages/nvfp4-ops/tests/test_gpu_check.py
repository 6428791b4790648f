"""ci/gpu-check.sh against the documents it implements: TE installed as the README installs it, and
the GPU-only risks of docs/ops.md printed, each with what on a GPU would show it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "ci" / "gpu-check.sh"
pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="not run from a repository checkout")


def _te_install_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"install .*transformer.engine", line)]


def test_gpu_check_installs_te_as_the_readme_does():
    readme = _te_install_lines((REPO / "README.md").read_text())
    script = _te_install_lines(SCRIPT.read_text())
    assert readme and script, (readme, script)
    for line in readme + script:  # built against the installed jax, not an isolated one
        assert "--no-build-isolation" in line and '"transformer_engine[jax]>=2.14"' in line, line


def test_gpu_check_prints_every_gpu_only_risk_with_what_shows_it():
    command = next(line for line in SCRIPT.read_text().splitlines() if "gpu-only-risks" in line)
    printed = subprocess.run(
        f"{command.strip().rstrip(chr(92))} | grep -v '^<!--'",
        shell=True, cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    risks = re.split(r"\n(?=\d+\. )", printed.strip())
    assert len(risks) >= 5, printed
    for number, risk in enumerate(risks, start=1):
        assert risk.startswith(f"{number}. ") and "Shown by:" in risk, risk
