"""The commands a user can copy from the docs, and how the tests run them (test_docs_*.py).

The ```bash and ```python blocks of README.md, packages/*/README.md and docs/*.md (and untagged
blocks whose lines start with `$ `, a command followed by what it prints) are extracted in
reading order: the README's quick start first, because later pages use the run it makes
(`runs/tiny`). The blocks that use that run (`quick_start_chain`) run one after the other in one
scratch directory, the other blocks in reading order in another; each directory holds a copy of
`examples/` and small stand-ins for the files the docs name as the reader's own (`corpus/`,
`tokenizer.json`, `my_text.txt`, `model.safetensors`, a Hugging Face model `SmolLM2-135M/`, ...:
`write_stand_ins`).

- A bash block runs command by command (`\\` continuations joined, `&&` chains split); each must
  exit 0. `pip install` commands are not run (the session has installed everything) but checked:
  every local path must exist and every extra it names must be declared by that package.
- A python block runs as a script and must exit 0.
- A `$ command` block runs the command; if what it shows starts with `error:`, the command must
  exit 2 and print that line, otherwise exit 0.
- A block directly preceded by `<!-- docs-test: skip (reason) -->` is not run; the reason is
  required. Only what needs a GPU, several hosts, hours, or is the test suite itself is skipped.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
FIRST = ("README.md", "packages/nvfp4-train/README.md", "packages/nvfp4-export/README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*(?:\((?P<reason>[^)]*)\))?\s*-->\s*$")
PIP = (("pip", "install"), ("python", "-m", "pip", "install"), ("python3", "-m", "pip", "install"))
PIP_VALUE_OPTIONS = {"--index-url", "--extra-index-url", "-i", "-r", "-c", "-f", "--find-links"}
REDIRECTIONS = {">", ">>", "<"}
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Block:
    """One code block of a doc page: where it is, its kind and text, and why it is skipped."""

    doc: str
    line: int
    kind: str  # "bash", "python" or "console" ($ lines)
    text: str
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_pages(repo: Path) -> list[str]:
    """The pages in reading order: the quick start and the pages that build on it first."""
    pages = [
        "README.md",
        *sorted(p.relative_to(repo).as_posix() for p in repo.glob("packages/*/README.md")),
    ]
    pages += sorted(p.relative_to(repo).as_posix() for p in (repo / "docs").glob("*.md"))
    return [*FIRST, *(p for p in pages if p not in FIRST)]


def blocks_of(doc: str, text: str) -> list[Block]:
    """The runnable blocks of one page (bash, python, and `$ ` console blocks), in order.

    Raises:
        ValueError: a skip marker without a reason.
    """
    out = []
    for m in FENCE.finditer(text):
        lang, body = m.group(1), m.group(2)
        if lang in ("bash", "sh", "shell"):
            kind = "bash"
        elif lang == "python":
            kind = "python"
        elif lang in ("", "console") and body.startswith("$ "):
            kind = "console"
        else:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = None
        if marker := SKIP.search(before):
            skip = (marker.group("reason") or "").strip()
            if not skip:
                raise ValueError(f"{doc}: a docs-test skip marker needs a reason: {before!r}")
        out.append(Block(doc, text[: m.start()].count("\n") + 1, kind, body, skip))
    return out


def shell_commands(script: str) -> list[list[str]]:
    """The commands of a bash block as word lists: continuations joined, comments dropped,
    `&&` chains split, redirections kept as words (`>`). Blank and comment-only lines give
    nothing."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word in ("&&", ";"):
                commands.append(words)
                words = []
            elif word in ("|", "||", "&"):
                raise ValueError(f"pipes and background jobs are not run by this test: {line!r}")
            else:
                words.append(word)
        commands.append(words)
    return [c for c in commands if c]


def command_line(words: list[str]) -> str:
    """`words` as one bash command line: each word quoted, redirections left as they are."""
    return " ".join(w if w in REDIRECTIONS else shlex.quote(w) for w in words)


def pip_problems(words: list[str], repo: Path) -> list[str] | None:
    """None if `words` is not a pip install; else what is wrong with its local requirements."""
    prefix = next((p for p in PIP if tuple(words[: len(p)]) == p), None)
    if prefix is None:
        return None
    problems, args = [], iter(words[len(prefix) :])
    for arg in args:
        if arg in PIP_VALUE_OPTIONS:
            next(args, None)
            continue
        if arg.startswith("-") or not ("/" in arg or arg.startswith(".")):
            continue  # an option, or a requirement from an index
        path, _, extras = arg.partition("[")
        package = repo / path
        if not (package / "pyproject.toml").is_file():
            problems.append(f"{arg}: {path} is not a package of this repository")
            continue
        declared = tomllib.loads((package / "pyproject.toml").read_text())["project"]
        declared = set(declared.get("optional-dependencies", {}))
        for extra in filter(None, extras.rstrip("]").split(",")):
            if extra.strip() not in declared:
                problems.append(f"{arg}: {path} declares no extra {extra.strip()!r}")
    return problems


def console_commands(text: str) -> list[tuple[str, list[str]]]:
    """The `$ command` lines of a console block, each with the lines shown after it."""
    runs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        elif runs:
            runs[-1][1].append(line)
    return runs


def all_blocks(repo: Path) -> list[Block]:
    return [b for page in doc_pages(repo) for b in blocks_of(page, (repo / page).read_text())]


BLOCKS = all_blocks(REPO)


def write_stand_ins(root: Path) -> None:
    """The files the docs name as the reader's own, small and real."""
    from hf_models import make_model
    from safetensors.numpy import save_file

    import nvfp4_format as nf
    from nvfp4_train.data.builtin_text import kjv_chapters
    from nvfp4_train.data.tokenization import train_bpe

    shutil.copytree(REPO / "examples", root / "examples")
    chapters = kjv_chapters()[:100]
    (root / "corpus").mkdir()
    for i, chapter in enumerate(chapters):
        (root / "corpus" / f"{i:03d}.txt").write_text(chapter, encoding="utf-8")
    (root / "my_text.txt").write_text("\n".join(chapters[:4]), encoding="utf-8")
    train_bpe(chapters, 512, "<|endoftext|>").hf.save(str(root / "tokenizer.json"))
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    q = nf.quantize(w, block_shape=(16, 16))
    m = "model.layers.0.mlp.down_proj"
    tensors = {
        f"{m}.weight_packed": np.asarray(q.packed),
        f"{m}.weight_scale": np.asarray(q.block_scales),
        f"{m}.weight_global_scale": (1 / np.asarray(q.global_scale, np.float32)).reshape(1),
    }
    for path in ("model.safetensors", "other.safetensors", "path/to/model.safetensors"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(root / path), metadata={"format": "pt"})
    (root / "exported").mkdir()
    save_file(tensors, str(root / "exported" / "model.safetensors"), metadata={"format": "pt"})
    # the Hugging Face model the train README's guide starts from: small, random, Llama 3.2-style
    make_model("llama3.2", root / "SmolLM2-135M")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVFP4_", "XLA_FLAGS"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _failure(what: str, proc: subprocess.CompletedProcess) -> str:
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
    return f"{what} exited {proc.returncode}:\n{tail}"


def _run_bash(block: Block, cwd: Path) -> None:
    for words in shell_commands(block.text):
        problems = pip_problems(words, REPO)
        if problems is not None:
            assert not problems, f"{block.where}: {problems}"
            continue
        command = command_line(words)
        proc = _run(["bash", "-c", command], cwd)
        assert proc.returncode == 0, _failure(f"{block.where}: {command}", proc)


def _run_python(block: Block, cwd: Path) -> None:
    script = cwd / f"_doc_{Path(block.doc).stem}_{block.line}.py"
    script.write_text(block.text)
    proc = _run([sys.executable, script.name], cwd)
    assert proc.returncode == 0, _failure(f"{block.where}: python block", proc)


def _run_console(block: Block, cwd: Path) -> None:
    for command, shown in console_commands(block.text):
        proc = _run(["bash", "-c", command], cwd)
        if shown and shown[0].startswith("error:"):
            assert proc.returncode == 2, _failure(f"{block.where}: {command}", proc)
            assert shown[0] in proc.stderr.splitlines(), (block.where, proc.stderr)
        else:
            assert proc.returncode == 0, _failure(f"{block.where}: {command}", proc)


RUNNERS = {"bash": _run_bash, "python": _run_python, "console": _run_console}


def run_block(block: Block, cwd: Path) -> None:
    """Runs `block` in `cwd` (its commands must succeed; see the module docstring), or skips
    it with its marker's reason."""
    if block.skip:
        pytest.skip(f"docs-test: skip ({block.skip})")
    RUNNERS[block.kind](block, cwd)


def scratch_fixture(prefix: str):
    """A module-scoped fixture: a fresh directory `prefix`-N holding the stand-ins. Each test
    module that runs blocks assigns its own (`scratch = scratch_fixture(...)`), so the modules'
    blocks never share files and run in parallel."""

    @pytest.fixture(scope="module")
    def scratch(tmp_path_factory):
        root = tmp_path_factory.mktemp(prefix)
        write_stand_ins(root)
        return root

    return scratch


RUN_DIR = re.compile(r"runs/[\w.-]+")
QUICK_START_CONFIG = "examples/configs/tiny.yaml"


def run_dirs(block: Block, default: str) -> set[str]:
    """The run directories `block` names, and `default` (the quick start config's output_dir)
    if a line of it runs that config without setting `output_dir=`."""
    named = set(RUN_DIR.findall(block.text))
    for line in block.text.replace("\\\n", " ").splitlines():
        if QUICK_START_CONFIG in line and "output_dir=" not in line:
            named.add(default)
    return named


def quick_start_chain(blocks: list[Block]) -> tuple[list[Block], list[Block]]:
    """(the quick start's chain, the other blocks), each in reading order.

    The chain is the README's first block, which trains `examples/configs/tiny.yaml` into its
    `output_dir` (runs/tiny), and every later block that uses a run directory the chain has
    used (runs/tiny by name or by running that config as it is, then runs/tiny-bf16,
    runs/tiny-ct, ...). No other block reads what the chain writes, so the two lists run in
    separate scratch directories, in parallel.
    """
    config = yaml.safe_load((REPO / QUICK_START_CONFIG).read_text())
    made = {config["output_dir"]}
    chain, rest = [blocks[0]], []
    for block in blocks[1:]:
        named = run_dirs(block, config["output_dir"])
        if named & made:
            chain.append(block)
            made |= named
        else:
            rest.append(block)
    return chain, rest
