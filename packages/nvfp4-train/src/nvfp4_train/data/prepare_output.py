"""The output directory of `prepare-data`: which directories it may write into, which files in them
are its own, and the checks before it resumes an interrupted preparation or vouches for a finished
one.

- A directory is prepare-data's when it holds `prepare-state.json` (interrupted) or
  `manifest.json` (finished) of the prepared-corpus format. prepare-data writes only into such a
  directory, a new one, or an empty one: any other directory is refused, untouched.
- In its own directory it owns exactly the names it writes: `shard-NNNNN.bin`, `tokenizer.json`,
  `prepare-state.json`, `manifest.json` and their `.tmp` files. Anything else there (your
  `notes.md`, `shard-notes.md`) is never read, overwritten or deleted.
- Resuming, and rerunning a finished corpus, compare every input's size and SHA-256, the
  tokenizer copy's SHA-256, and every listed shard's size and SHA-256 with the state or the
  manifest: a difference is an error naming the file (`resume_problem`, `finished_problem`).

Example:
    >>> import tempfile
    >>> claim_output(Path(tempfile.mkdtemp()) / "new")
    'new'
"""

import json
import re
from collections.abc import Sequence
from pathlib import Path

from nvfp4_train.data.prepared import FORMAT, MANIFEST, STATE, VERSION, file_sha256
from nvfp4_train.data.tokenization import TOKENIZER_FILE
from nvfp4_train.errors import DataError

OWN_SHARD = re.compile(r"shard-\d{5}\.bin(\.tmp)?")
OWN_TEMPORARY = (STATE + ".tmp", MANIFEST + ".tmp", TOKENIZER_FILE + ".tmp")
_NEXT = ("source", "record")
_FIELDS = {
    STATE: {"shards": list, "sources": list, "tokenizer": dict, "dtype": str, "next": dict},
    MANIFEST: {"shards": list, "sources": list, "tokenizer": dict, "dtype": str, "tokens": int},
}


def claim_output(out: Path) -> str:
    """ "finished" (it holds a manifest), "resume" (a state) or "new" (absent or empty).

    Raises:
        DataError: `out` is a file, or a directory with other files and neither a state nor a
            manifest (one prepare-data did not make).
    """
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {str(out)!r} is a file; prepare-data writes a directory")
    if (out / MANIFEST).is_file():
        return "finished"
    if (out / STATE).is_file():
        return "resume"
    others = (
        sorted(p.name for p in out.iterdir() if p.name not in OWN_TEMPORARY) if out.exists() else []
    )
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise DataError(
            f"--output {str(out)!r} holds files prepare-data did not write ({shown}) and no "
            f"{STATE} or {MANIFEST}; it writes only into a new or empty directory: choose one"
        )
    return "new"


def _is_shard(entry: object) -> bool:
    """A shard entry names a file of its own pattern only (never a path elsewhere)."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("file"), str)
        and re.fullmatch(r"shard-\d{5}\.bin", entry["file"]) is not None
        and isinstance(entry.get("tokens"), int)
        and isinstance(entry.get("sha256"), str)
    )


def read_own(out: Path, name: str) -> dict:
    """`out/name` (the state or the manifest), checked to be prepare-data's and readable.

    Raises:
        DataError: not JSON, not an object of the prepared-corpus format, or missing a field.
    """
    file = out / name
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        why = f"not JSON: {e}"
    else:
        fields = _FIELDS[name]
        if not isinstance(content, dict) or content.get("format") != FORMAT:
            why = f"not a {FORMAT} file"
        elif content.get("version") != VERSION:
            why = f"version {content.get('version')!r}; this nvfp4-train reads {VERSION}"
        elif any(not isinstance(content.get(k), t) for k, t in fields.items()):
            why = f"it lacks one of {', '.join(fields)}"
        elif not all(map(_is_shard, content["shards"])):
            why = "a shard entry is not {file: shard-NNNNN.bin, tokens, sha256}"
        elif not all(isinstance(s, dict) for s in content["sources"]):
            why = "a source entry is not an object"
        elif name == STATE and not all(isinstance(content["next"].get(k), int) for k in _NEXT):
            why = "next is not {source, record}"
        else:
            return content
    raise DataError(
        f"--output {str(out)!r}: {name} is damaged or not prepare-data's ({why}); prepare-data "
        "leaves it as it is: choose a new --output, or delete the directory if it is a damaged "
        "corpus"
    )


def _settings_problem(saved: dict, settings: dict) -> str | None:
    changed = []
    for key, value in settings.items():
        if saved.get(key) == value:
            continue
        if key == "inputs" and isinstance(saved.get(key), list):
            added = [p for p in value if p not in saved[key]]
            removed = [p for p in saved[key] if p not in value]
            changed.append(f"inputs: added {added[:2]}, removed {removed[:2]}")
        else:
            changed.append(f"{key}: {saved.get(key)!r} there, {value!r} now")
    return "; ".join(changed) or None


def _inputs_problem(sources: list, files: Sequence[Path], since: str) -> str | None:
    for source, file in zip(sources, files, strict=True):
        size = file.stat().st_size
        if size != source.get("bytes") or file_sha256(file) != source.get("sha256"):
            what = "size" if size != source.get("bytes") else "SHA-256"
            return f"input {str(file)!r} changed since {since} (its {what} differs)"
    return None


def _files_problem(out: Path, content: dict, name: str) -> str | None:
    """The first of the tokenizer copy and the listed shards that is missing or changed."""
    copy = out / TOKENIZER_FILE
    expected = content["tokenizer"].get("sha256")
    if not copy.is_file() or file_sha256(copy) != expected:
        return f"{str(copy)!r} is missing or is not the tokenizer {name} names"
    itemsize = 2 if content.get("dtype") == "uint16" else 4
    for shard in content["shards"]:
        file = out / shard["file"]
        if not file.is_file():
            return f"shard {str(file)!r}, listed in {name}, is missing"
        if (
            file.stat().st_size != shard["tokens"] * itemsize
            or file_sha256(file) != shard["sha256"]
        ):
            return f"shard {str(file)!r} does not match {name} (size or SHA-256): it was changed"
    return None


def resume_problem(out: Path, state: dict, settings: dict, files: Sequence[Path]) -> str | None:
    """Why the interrupted preparation in `out` cannot be continued with `settings` and `files`
    (None: it can): other settings, a changed input, a changed tokenizer copy or shard."""
    other = _settings_problem(state, settings)
    if other:
        return (
            f"--output {str(out)!r} holds an interrupted preparation with other settings "
            f"({other}); rerun it with its arguments, or choose a new --output"
        )
    problem = _inputs_problem(state["sources"], files, "the interrupted preparation began")
    problem = problem or _files_problem(out, state, STATE)
    if problem:
        return f"cannot resume the preparation in --output {str(out)!r}: {problem}; choose a new --output"
    return None


def finished_problem(
    out: Path, manifest: dict, settings: dict, files: Sequence[Path]
) -> str | None:
    """Why the finished corpus in `out` is not what `settings` and `files` would prepare, or is
    damaged (None: it is the corpus they prepare, intact)."""
    other = _settings_problem(manifest, settings)
    if other:
        return (
            f"--output {str(out)!r} already holds a prepared corpus made with other arguments "
            f"({other}); choose a new --output"
        )
    problem = _inputs_problem(
        manifest["sources"], files, f"the corpus in {str(out)!r} was prepared"
    )
    if problem:
        return f"{problem}; prepare it into a new --output"
    problem = _files_problem(out, manifest, MANIFEST)
    if problem:
        return f"the prepared corpus {str(out)!r} is damaged: {problem}; prepare it into a new --output"
    return None


def remove_leftovers(out: Path, state: dict) -> None:
    """Deletes what an interrupted run wrote after its last saved state: its shards the state does
    not list and its temporary files (only names prepare-data writes)."""
    listed = {shard["file"] for shard in state["shards"]}
    for file in out.iterdir():
        own = OWN_SHARD.fullmatch(file.name) or file.name in OWN_TEMPORARY
        if own and file.name not in listed and file.is_file():
            file.unlink()


def remove_own_files(out: Path, state: dict) -> None:
    """Deletes every file prepare-data wrote in `out`: shards, temporary files, the tokenizer
    copy, the state (the directory keeps anything else)."""
    for shard in state["shards"]:
        (out / shard["file"]).unlink(missing_ok=True)
    remove_leftovers(out, state)
    (out / TOKENIZER_FILE).unlink(missing_ok=True)
    (out / STATE).unlink(missing_ok=True)
