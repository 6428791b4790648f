"""Downstream task files: what `nvfp4-train eval RUN --tasks FILE` reads.

Four kinds of file, each read into one `Task`:
- plain JSONL (`*.jsonl`): one example a line, `{"context": str, "choices": [str, ...], "gold":
  int}` (multiple choice; a choice follows its context after one space, unless it starts
  with whitespace of its own: `Task.continuation`), or `{"text": str}`
  (rolling log-likelihood, one document a line);
- plain text (`*.txt`): one document, scored by rolling log-likelihood;
- an lm-evaluation-harness task YAML over local data (`dataset_path: json`, `dataset_kwargs:
  {data_files: ...}`, `output_type: multiple_choice` or `loglikelihood_rolling`, `doc_to_text`,
  `doc_to_choice`, `doc_to_target`, `target_delimiter` in their simple forms: `template`);
- a BIG-bench `task.json` with `target_scores` examples (multiple choice).

Every mistake is a `TaskError` naming the file and, where it is one example's, its line or index.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml

from nvfp4_train.tasks.task_error import TaskError
from nvfp4_train.tasks.template import render

MULTIPLE_CHOICE = "multiple_choice"
ROLLING = "loglikelihood_rolling"


@dataclasses.dataclass(frozen=True)
class ChoiceExample:
    """One multiple-choice example.

    Attributes:
        context: the text the choices continue.
        choices: the answers as written (the continuation is `Task.delimiter + choice`).
        gold: index of the right answer in `choices`.
        where: "file:line" (JSONL) or "file: example i" (YAML data, BIG-bench), for messages.
    """

    context: str
    choices: tuple[str, ...]
    gold: int
    where: str


@dataclasses.dataclass(frozen=True)
class Task:
    """A task read from one file.

    Attributes:
        name: the YAML's `task`, the BIG-bench `name`, else the file's stem (a `task.json`:
            its directory's name).
        path: the file it was read from.
        kind: `MULTIPLE_CHOICE` or `ROLLING`.
        examples: the multiple-choice examples (empty for a rolling task).
        documents: the rolling task's documents (empty for a multiple-choice task).
        delimiter: what goes between a context and each choice (lm-eval's `target_delimiter`).
    """

    name: str
    path: str
    kind: Literal["multiple_choice", "loglikelihood_rolling"]
    examples: tuple[ChoiceExample, ...] = ()
    documents: tuple[str, ...] = ()
    delimiter: str = " "

    def __len__(self) -> int:
        return len(self.examples) if self.kind == MULTIPLE_CHOICE else len(self.documents)

    def continuation(self, choice: str) -> str:
        """What is scored after the context: `delimiter + choice`, or `choice` alone when the
        delimiter is whitespace and the choice starts with whitespace (an ending stored with
        its leading space, as many lm-eval datasets store them: no doubled space)."""
        return choice if self._keeps_own_space(choice) else self.delimiter + choice

    def _keeps_own_space(self, choice: str) -> bool:
        return self.delimiter.isspace() and choice[:1].isspace()

    def warnings(self) -> list[str]:
        """One `warning:` line when choices start with whitespace (see `continuation`)."""
        spaced = sum(self._keeps_own_space(c) for e in self.examples for c in e.choices)
        if not spaced:
            return []
        return [f"warning: {self.path}: {spaced} choice(s) start with whitespace; the delimiter "
                f"{self.delimiter!r} is not added before them (no doubled space)"]  # fmt: skip


def load_task(path: str | Path) -> Task:
    """Reads one task file (its kind from its name: `.jsonl`, `.txt`, `.yaml`/`.yml`, `.json`).

    Raises:
        TaskError: an unknown kind of file, a file that is not UTF-8, an unsupported feature, a
            missing field, a gold index out of range, a target_score that is not finite, an
            empty task (each naming the file and example or byte).
        OSError: the file cannot be read.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    readers = {".jsonl": _read_jsonl_task, ".txt": _read_text, ".yaml": _read_yaml,
               ".yml": _read_yaml, ".json": _read_bigbench}  # fmt: skip
    if suffix not in readers:
        raise TaskError(
            f"{path}: unknown kind of task file {suffix or '(no suffix)'!r}; expected .jsonl, "
            ".txt, .yaml/.yml (lm-evaluation-harness) or .json (BIG-bench)"
        )
    task = readers[suffix](path)
    if len(task) == 0:
        raise TaskError(f"{path}: the task has no examples")
    return task


def read_utf8(path: Path) -> str:
    """The text of `path`, read as UTF-8.

    Raises:
        TaskError: the file is not UTF-8, naming it and the offset of the first bad byte.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start : e.start + 1]
        raise TaskError(f"{path}: not UTF-8 text (byte {e.start}: {bad!r}); task files and "
                        "their data are read as UTF-8") from None  # fmt: skip


def _read_text(path: Path) -> Task:
    text = read_utf8(path)
    return Task(path.stem, str(path), ROLLING, documents=(text,) if text.strip() else ())


def _jsonl_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line."""
    rows = []
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{number}: not JSON: {e.msg}") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    return rows


def _read_jsonl_task(path: Path) -> Task:
    rows = _jsonl_rows(path)
    if rows and "text" in rows[0][1] and "choices" not in rows[0][1]:
        docs = tuple(_field(row, "text", str, f"{path}:{n}") for n, row in rows)
        return Task(path.stem, str(path), ROLLING, documents=docs)
    examples = []
    for number, row in rows:
        where = f"{path}:{number}"
        context = _field(row, "context", str, where)
        choices = _choices(_field(row, "choices", list, where), where)
        gold = _gold(_field(row, "gold", int, where), choices, where)
        examples.append(ChoiceExample(context, choices, gold, where))
    return Task(path.stem, str(path), MULTIPLE_CHOICE, examples=tuple(examples))


def _field(row: dict, name: str, kind: type, where: str) -> Any:
    if name not in row:
        raise TaskError(f"{where}: missing field {name!r} (has {sorted(row)})")
    value = row[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TaskError(f"{where}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _choices(values: list, where: str) -> tuple[str, ...]:
    if len(values) < 2:
        raise TaskError(f"{where}: needs at least 2 choices, got {len(values)}")
    bad = [v for v in values if not isinstance(v, str)]
    if bad:
        raise TaskError(f"{where}: choices must be strings, got {bad[0]!r}")
    return tuple(values)


def _gold(gold: int, choices: tuple[str, ...], where: str) -> int:
    if not 0 <= gold < len(choices):
        raise TaskError(f"{where}: gold index {gold} out of range for {len(choices)} choices")
    return gold


# lm-evaluation-harness task YAML ---------------------------------------------------------------

YAML_IGNORED = frozenset({
    "tag", "group", "task_alias", "dataset_name", "training_split", "validation_split",
    "test_split", "fewshot_split", "metric_list", "metadata", "should_decontaminate",
    "doc_to_decontamination_query", "fewshot_delimiter", "output_type", "dataset_path",
    "dataset_kwargs", "data_files", "task", "doc_to_text", "doc_to_choice", "doc_to_target",
    "target_delimiter", "description", "num_fewshot",
})  # fmt: skip
"""Keys read here, or ignored because they do not change a zero-shot log-likelihood score."""


def _read_yaml(path: Path) -> Task:
    try:
        spec = yaml.safe_load(read_utf8(path))
    except yaml.constructor.ConstructorError as e:
        tag = getattr(e, "problem", "") or ""
        raise TaskError(
            f"{path}: unsupported feature: YAML tag ({tag.strip()}); "
            "`!function` and other tags are not read (only plain YAML)"
        ) from None
    except yaml.YAMLError as e:
        raise TaskError(f"{path}: not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(spec, dict):
        raise TaskError(f"{path}: expected a mapping of lm-eval task keys")
    unsupported = sorted(set(spec) - YAML_IGNORED)
    if unsupported:
        raise TaskError(f"{path}: unsupported feature: {unsupported[0]!r} (supported: zero-shot "
                        "multiple_choice / loglikelihood_rolling over local JSON data)")  # fmt: skip
    if spec.get("num_fewshot", 0) not in (0, None):
        raise TaskError(f"{path}: unsupported feature: num_fewshot={spec['num_fewshot']} (0 only)")
    output_type = spec.get("output_type", MULTIPLE_CHOICE)
    if output_type not in (MULTIPLE_CHOICE, ROLLING):
        raise TaskError(f"{path}: unsupported feature: output_type {output_type!r}")
    docs = _yaml_docs(path, spec)
    name = str(spec.get("task", path.stem))
    if output_type == ROLLING:
        texts = [_text(spec, "doc_to_target", doc, where) for where, doc in docs]
        return Task(name, str(path), ROLLING, documents=tuple(texts))
    delimiter = spec.get("target_delimiter", " ")
    if not isinstance(delimiter, str):
        raise TaskError(f"{path}: target_delimiter must be a string, got {delimiter!r}")
    examples = tuple(_yaml_example(spec, doc, where) for where, doc in docs)
    return Task(name, str(path), MULTIPLE_CHOICE, examples=examples, delimiter=delimiter)


def _data_file(path: Path, spec: dict) -> Path:
    """The local JSON / JSONL file of the split the YAML evaluates (test, else validation)."""
    if spec.get("dataset_path") != "json":
        raise TaskError(
            f"{path}: unsupported feature: dataset_path {spec.get('dataset_path')!r} (only "
            "'json' with local data_files: Hugging Face Hub datasets are not downloaded)"
        )
    kwargs = spec.get("dataset_kwargs") or {}
    files = kwargs.get("data_files", spec.get("data_files")) if isinstance(kwargs, dict) else None
    if isinstance(files, dict):
        split = spec.get("test_split") or spec.get("validation_split")
        if split is None and len(files) == 1:
            split = next(iter(files))
        if split not in files:
            raise TaskError(f"{path}: data_files has no split {split!r} (has {sorted(files)})")
        files = files[split]
    if isinstance(files, list) and len(files) == 1:
        files = files[0]
    if not isinstance(files, str):
        raise TaskError(f"{path}: needs one local file in dataset_kwargs.data_files, got {files!r}")
    return _local_file(path, Path(files))


def _local_file(yaml_path: Path, file: Path) -> Path:
    """`file` relative to the YAML's directory, else to the current directory (where lm-eval
    resolves it), else to a directory above the YAML (a repository root lm-eval runs from)."""
    if file.is_absolute():
        return file
    here = yaml_path.resolve().parent
    for base in (here, Path.cwd(), *here.parents):
        if (base / file).is_file():
            return base / file
    raise TaskError(
        f"{yaml_path}: data file {str(file)!r} not found next to the YAML, in the current "
        "directory or a directory above the YAML"
    )


def _yaml_docs(path: Path, spec: dict) -> list[tuple[str, dict]]:
    data = _data_file(path, spec)
    if data.suffix.lower() == ".jsonl":
        return [(f"{path} ({data}:{n})", row) for n, row in _jsonl_rows(data)]
    try:
        rows = json.loads(read_utf8(data))
    except json.JSONDecodeError as e:
        raise TaskError(f"{data}: not JSON: {e.msg} (line {e.lineno})") from None
    if isinstance(rows, dict) and isinstance(rows.get("data"), list):
        rows = rows["data"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TaskError(f"{data}: expected a list of JSON objects (or JSONL)")
    return [(f"{path} ({data}: example {i})", row) for i, row in enumerate(rows)]


def _value(spec: dict, key: str, doc: dict, where: str) -> Any:
    """lm-eval's `doc_to_*`: a field name, a literal (list or int), or a `{{ field }}` template."""
    if key not in spec:
        raise TaskError(f"{where}: the task YAML has no {key}")
    rule = spec[key]
    if isinstance(rule, str) and rule in doc:
        return doc[rule]
    if isinstance(rule, str):
        return render(rule, doc, where)
    if isinstance(rule, list):
        return [render(r, doc, where) if isinstance(r, str) else r for r in rule]
    if isinstance(rule, int) and not isinstance(rule, bool):
        return rule
    raise TaskError(f"{where}: unsupported feature: {key} of type {type(rule).__name__}")


def _text(spec: dict, key: str, doc: dict, where: str) -> str:
    value = _value(spec, key, doc, where)
    if not isinstance(value, str):
        raise TaskError(f"{where}: {key} must give a string, got {value!r}")
    return value


def _yaml_example(spec: dict, doc: dict, where: str) -> ChoiceExample:
    context = _text(spec, "doc_to_text", doc, where)
    description = spec.get("description", "")
    if description:
        context = render(str(description), doc, where) + context
    choices = _value(spec, "doc_to_choice", doc, where)
    if not isinstance(choices, list):
        raise TaskError(f"{where}: doc_to_choice must give a list, got {choices!r}")
    choices = _choices([str(c) if isinstance(c, int) else c for c in choices], where)
    target = _value(spec, "doc_to_target", doc, where)
    rule = spec["doc_to_target"]
    templated = isinstance(rule, str) and rule not in doc  # lm-eval: a rendered digit is an index
    if isinstance(target, str) and templated and target.strip().isdigit():
        target = int(target)
    elif isinstance(target, str):
        if target not in choices:
            raise TaskError(f"{where}: doc_to_target {target!r} is not one of the choices")
        target = choices.index(target)
    if not isinstance(target, int) or isinstance(target, bool):
        raise TaskError(f"{where}: doc_to_target must give an index or a choice, got {target!r}")
    return ChoiceExample(context, choices, _gold(target, choices, where), where)


# BIG-bench task.json --------------------------------------------------------------------------

BIGBENCH_DEFAULTS = {
    "task_prefix": "",
    "example_input_prefix": "\nQ: ",
    "example_output_prefix": "\nA: ",
    "choice_prefix": "\n  choice: ",
    "append_choices_to_input": True,
}


def _read_bigbench(path: Path) -> Task:
    try:
        spec = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}: not JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("examples"), list):
        raise TaskError(f"{path}: a BIG-bench task.json needs a list 'examples'")
    settings = {k: spec.get(k, v) for k, v in BIGBENCH_DEFAULTS.items()}
    examples = []
    for i, example in enumerate(spec["examples"]):
        where = f"{path}: example {i}"
        if not isinstance(example, dict):
            raise TaskError(f"{where}: expected a JSON object")
        if "target_scores" not in example:
            raise TaskError(
                f"{where}: missing field 'target_scores' (only multiple-choice examples are read)"
            )
        examples.append(_bigbench_example(example, settings, where))
    name = spec.get("name") or (path.parent.name if path.name == "task.json" else path.stem)
    return Task(str(name), str(path), MULTIPLE_CHOICE, examples=tuple(examples), delimiter="")


def _bigbench_example(example: dict, settings: dict, where: str) -> ChoiceExample:
    scores = _field(example, "target_scores", dict, where)
    choices = _choices(list(scores), where)
    values = list(scores.values())
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise TaskError(f"{where}: target_scores must be numbers, got {values}")
    bad = [(c, v) for c, v in scores.items() if not math.isfinite(v)]
    if bad:
        raise TaskError(f"{where}: target_scores must be finite, got {bad[0][1]} for "
                        f"{bad[0][0]!r}")  # fmt: skip
    best = max(values)
    if values.count(best) != 1:
        raise TaskError(f"{where}: {values.count(best)} choices share the top target_score "
                        f"{best}; one right answer is supported")  # fmt: skip
    text = _field(example, "input", str, where)
    if settings["append_choices_to_input"]:
        text += settings["choice_prefix"] + settings["choice_prefix"].join(choices)
    context = (settings["task_prefix"] + settings["example_input_prefix"] + text
               + settings["example_output_prefix"])  # fmt: skip
    return ChoiceExample(context, choices, values.index(best), where)
