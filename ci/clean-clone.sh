#!/usr/bin/env bash
# Run CI's job the way CI does: on a fresh clone of the committed HEAD, so that nothing
# uncommitted or hand-installed in this working tree can make it pass.
#   bash ci/clean-clone.sh [nox args, e.g. -s format]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work/repo"
cd "$work/repo"
if [ "$#" -gt 0 ]; then
  python3 -m pip install --quiet --disable-pip-version-check "nox[uv]>=2024.10"
  CI=true python3 -m nox "$@"
else
  CI=true bash .ci/run
fi
