"""`nvfp4_export.json`, the manifest every export directory holds, and what it proves.

Besides the provenance (`hf_export`: source step, spec, recipes, input amax and where they came
from), the manifest seals the export (`seal`): `files` maps every other file export wrote to its
size and SHA-256, and `manifest_sha256` is the SHA-256 of the manifest's own canonical JSON
(`json_files.canonical_json`) without that key. `sealing_problems` checks both, so a `verify`
that passes means the files are the ones written. Exports written before the seal have neither;
`sealing_problems` then says the files were not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nvfp4_export.json_files import file_sha256, json_sha256

MANIFEST = "nvfp4_export.json"
"""The file every export directory holds (its provenance); what marks it as replaceable."""
FILES = "files"
"""Manifest key: {file name: {"bytes": int, "sha256": hex}} of every other file of the export."""
SELF_SHA256 = "manifest_sha256"
"""Manifest key: SHA-256 of the manifest's canonical JSON without this key."""
LOADED_SUFFIXES = (".json", ".safetensors")
"""Files a loader reads by name pattern: one in the directory that the export did not write is a
problem (a server would read it), any other extra file (a README) is not."""
OLDER_VERSION = "files not checked: written by an older version of nvfp4-export (no file hashes)"
STANDINS = "standins"
"""Manifest key: {training linear: added weight error} of the linears stored in a stand-in format
(an MXFP8 linear as FP8 per tensor in ModelOpt, `eight_bit_formats`); {} when none."""
CHECKPOINT_CHECKED = "checkpoint_checked"
"""Manifest key: {"parameters": bool, "config": bool}, what of the checkpoint export checked."""


def seal(manifest: dict[str, Any], out_dir: Path, files: Sequence[str]) -> dict[str, Any]:
    """`manifest` with the size and SHA-256 of each of `files` (in `out_dir`) and its own hash."""
    hashes = {
        name: {"bytes": (out_dir / name).stat().st_size, "sha256": file_sha256(out_dir / name)}
        for name in sorted(files)
        if name != MANIFEST
    }
    sealed = {**manifest, FILES: hashes}
    return {**sealed, SELF_SHA256: json_sha256(sealed)}


def _file_problem(path: Path, name: str, want: Any) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{name} is missing (the export wrote it)"
    if not isinstance(want, dict) or file.stat().st_size != want.get("bytes"):
        return f"{name} is not the file the export wrote (its size differs)"
    if file_sha256(file) != want.get("sha256"):
        return f"{name} is not the file the export wrote (its SHA-256 differs)"
    return None


def sealing_problems(path: Path, manifest: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(problems, what could not be checked) of export directory `path` against its manifest."""
    hashes = manifest.get(FILES)
    if hashes is None and SELF_SHA256 not in manifest:
        return [], [OLDER_VERSION]
    rest = {k: v for k, v in manifest.items() if k != SELF_SHA256}
    problems = []
    if manifest.get(SELF_SHA256) != json_sha256(rest) or not isinstance(hashes, dict):
        problems.append(f"{MANIFEST} is not the one the export wrote (its SHA-256 differs)")
    hashes = hashes if isinstance(hashes, dict) else {}
    for name, want in sorted(hashes.items()):
        problem = _file_problem(path, name, want)
        if problem:
            problems.append(problem)
    extra = sorted(
        p.name
        for p in path.iterdir()
        if p.is_file()
        and p.suffix in LOADED_SUFFIXES
        and p.name not in hashes
        and p.name != MANIFEST
    )
    if extra:
        problems.append(f"files the export did not write, which loaders read: {extra[:5]}")
    return problems, _source_unchecked(manifest)


def _source_unchecked(manifest: dict[str, Any]) -> list[str]:
    checked = manifest.get(CHECKPOINT_CHECKED)
    checked = checked if isinstance(checked, dict) else {}
    if checked.get("parameters") is not True:
        return ["the checkpoint was exported without its integrity check (--no-integrity-check)"]
    if checked.get("config") is not True:
        return ["the checkpoint's config was exported unchecked (it had no config checksum)"]
    return []
