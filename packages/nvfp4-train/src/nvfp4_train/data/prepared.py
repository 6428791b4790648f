"""The prepared corpus on disk: token shards, the tokenizer, and a manifest that vouches for both.

`nvfp4-train prepare-data` writes a directory:

    manifest.json       written last: format, tokenizer hash, settings, sources (path, size,
                        SHA-256, counts), shards, totals, skipped input files
    tokenizer.json      the tokenizer that wrote the ids (a copy)
    shard-00000.bin     raw little-endian ids (uint16 below 65,536 ids, else uint32); every
    shard-00001.bin     document is followed by the separator `eos_token`, and no document
    ...                 straddles two shards

The separators are the document boundaries that document masks cut at. While the preparation
runs, its state is `prepare-state.json` instead of the manifest, so a directory is a complete
corpus exactly when it holds `manifest.json`: nothing partially written is ever read as complete.

`open_prepared(path)` checks the manifest against the files (sizes always, SHA-256 hashes for
corpora of up to `FULL_CHECK_MAX_TOKENS` tokens) and returns the lazily read `ShardStream`.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

from nvfp4_train.data.packing import FULL_CHECK_MAX_TOKENS
from nvfp4_train.data.streams import ShardStream
from nvfp4_train.data.tokenization import TOKENIZER_FILE
from nvfp4_train.errors import DataError

FORMAT = "nvfp4-train prepared corpus"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "prepare-state.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    """The SHA-256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_prepared(path: str | Path) -> bool:
    """True for a directory that `prepare-data` wrote (complete or interrupted)."""
    root = Path(path)
    return root.is_dir() and ((root / MANIFEST).is_file() or (root / STATE).is_file())


def write_json_atomically(path: Path, content: dict) -> None:
    """Writes `content` to `path` through a temporary file and a rename (never half a file)."""
    partial = path.with_name(path.name + ".tmp")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(json.dumps(content, indent=1) + "\n")
        f.flush()
    partial.replace(path)


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedCorpus:
    """A checked prepared corpus: its token stream and the tokenizer the ids belong to."""

    root: Path
    stream: ShardStream
    tokenizer_file: Path
    tokenizer_sha256: str
    eos_token: str
    vocab_size: int
    documents: int


def _read_manifest(root: Path) -> dict:
    file = root / MANIFEST
    if not file.is_file():
        raise DataError(
            f"data.path: {str(root)!r} is an unfinished prepare-data output (no {MANIFEST}); "
            "rerun the same prepare-data command to finish it"
        )
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"data.path: {str(file)!r} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"data.path: {str(file)!r} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DataError(
            f"data.path: {str(file)!r} has version {manifest.get('version')!r}; this "
            f"nvfp4-train reads version {VERSION}"
        )
    return manifest


def _check_shards(root: Path, manifest: dict, itemsize: int) -> list[Path]:
    files = []
    full_check = manifest["tokens"] <= FULL_CHECK_MAX_TOKENS
    for shard in manifest["shards"]:
        file = root / shard["file"]
        if not file.is_file():
            raise DataError(f"data.path: shard {str(file)!r} is missing")
        expected = shard["tokens"] * itemsize
        if file.stat().st_size != expected or (full_check and file_sha256(file) != shard["sha256"]):
            raise DataError(
                f"data.path: shard {str(file)!r} does not match {MANIFEST} (size or SHA-256): "
                "it is corrupted or was changed; prepare the corpus again"
            )
        files.append(file)
    if not files:
        raise DataError(f"data.path: the prepared corpus {str(root)!r} has no shards")
    return files


def open_prepared(path: str | Path) -> PreparedCorpus:
    """Opens the prepared corpus at `path` after checking it against its manifest.

    Raises:
        DataError: an unfinished or foreign directory, a missing, truncated or changed shard, or a
            tokenizer file that is not the one the manifest names.
    """
    root = Path(path)
    manifest = _read_manifest(root)
    tokenizer = manifest["tokenizer"]
    tokenizer_file = root / TOKENIZER_FILE
    if not tokenizer_file.is_file() or file_sha256(tokenizer_file) != tokenizer["sha256"]:
        raise DataError(
            f"data.path: {str(tokenizer_file)!r} is missing or is not the tokenizer of "
            f"{MANIFEST} (SHA-256 {tokenizer['sha256'][:12]}...)"
        )
    itemsize = 2 if manifest["dtype"] == "uint16" else 4
    stream = ShardStream(_check_shards(root, manifest, itemsize), manifest["dtype"])
    return PreparedCorpus(
        root=root,
        stream=stream,
        tokenizer_file=tokenizer_file,
        tokenizer_sha256=tokenizer["sha256"],
        eos_token=tokenizer["eos_token"],
        vocab_size=tokenizer["vocab_size"],
        documents=manifest["documents"],
    )
