#!/usr/bin/env bash
# The README's test command: install nox (with uv) and run every default session.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "nox[uv]>=2024.10"
python3 -m nox "$@"
