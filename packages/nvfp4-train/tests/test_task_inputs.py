"""Task inputs a user gets wrong without noticing ("Nothing silent, round three"): files that are
not UTF-8, non-finite BIG-bench scores, choices stored with their leading space, and items longer
than a row. No training: a fake log-probability function scores, as in test_tasks.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from nvfp4_train.cli import main
from nvfp4_train.data import id_tokenizer
from nvfp4_train.tasks import TaskError, choice_window, load_task, score_task
from nvfp4_train.training.downstream import format_table

LATIN1 = "caf\xe9 au lait".encode("latin-1")  # byte 3 is 0xE9, not UTF-8
"""A context in Latin-1: what a spreadsheet export or an old dataset file holds."""


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _target_logprob(inputs_BxL: np.ndarray, targets_BxL: np.ndarray):
    """A fake model (as test_tasks.py's): log p(target) = -0.1 * (target + 1)."""
    del inputs_BxL
    return (-0.1 * (targets_BxL + 1)).astype(np.float32), targets_BxL % 2 == 0


def _jsonl(path: Path, rows: list) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _latin1_files(root: Path) -> dict[str, Path]:
    """One task file of every kind with a Latin-1 byte at a known offset (the YAML's is in its
    data file, the others' in themselves)."""
    row = b'{"context": "' + LATIN1 + b'", "choices": ["a", "b"], "gold": 0}\n'
    _write(root / "data.jsonl", row)
    yaml_text = ("dataset_path: json\ndata_files: data.jsonl\ndoc_to_text: context\n"
                 "doc_to_choice: choices\ndoc_to_target: gold\n")  # fmt: skip
    return {
        "jsonl": _write(root / "t.jsonl", row),
        "text": _write(root / "t.txt", LATIN1),
        "yaml": _write(root / "t.yaml", b"task: x\n# " + LATIN1 + b"\ndataset_path: json\n"),
        "yaml data": _write(root / "y.yaml", yaml_text),
        "bigbench": _write(root / "task.json", b'{"description": "' + LATIN1 + b'"}'),
    }


@pytest.mark.parametrize("kind", ["jsonl", "text", "yaml", "yaml data", "bigbench"])
def test_a_task_file_that_is_not_utf8_is_named_with_its_byte(tmp_path, kind):
    path = _latin1_files(tmp_path)[kind]
    named = tmp_path / "data.jsonl" if kind == "yaml data" else path
    offset = named.read_bytes().index(b"\xe9")
    with pytest.raises(TaskError) as raised:
        load_task(path)
    message = str(raised.value)
    assert message.startswith(f"{named}: not UTF-8 text (byte {offset}: b'\\xe9')"), message
    assert "\n" not in message


def test_eval_and_a_run_config_refuse_a_non_utf8_task_in_one_line(tmp_path, capsys, tiny_config):
    bad = _latin1_files(tmp_path)["jsonl"]
    assert main(["eval", str(tmp_path / "no-run"), "--tasks", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    offset = bad.read_bytes().index(b"\xe9")
    assert err == f"error: {bad}: not UTF-8 text (byte {offset}: b'\\xe9'); task files and their " \
        "data are read as UTF-8"  # fmt: skip
    config = tiny_config(tmp_path / "run", eval={"tasks": [str(bad)]})
    config_file = _write(tmp_path / "run.yaml", yaml.safe_dump(config))
    assert main(["run", str(config_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad}: not UTF-8 text (byte {offset}" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("score", ["NaN", "Infinity", "-Infinity"])
def test_a_bigbench_target_score_that_is_not_finite_is_refused(tmp_path, score):
    scores = f'{{"yes": 1, "no": {score}}}'
    text = '{"examples": [{"input": "x", "target_scores": {"a": 1, "b": 0}}, ' \
        f'{{"input": "y", "target_scores": {scores}}}]}}'  # fmt: skip
    path = _write(tmp_path / "task.json", text)
    with pytest.raises(TaskError) as raised:
        load_task(path)
    assert str(raised.value) == (
        f"{path}: example 1: target_scores must be finite, got {float(score)} for 'no'"
    )
    assert json.loads(text)  # Python's json reads NaN / Infinity: the check is ours


def test_a_choice_longer_than_a_row_is_scored_on_its_last_tokens(tmp_path):
    """lm-evaluation-harness's rule: keep the last seq_len + 1 tokens of context + continuation
    and score the continuation tokens among them; the task goes on and counts the cut item."""
    w = choice_window([5], [6, 7, 8, 9], seq_len=2)
    assert (w.tokens.tolist(), w.score_from, w.truncated, w.unscored) == ([7, 8, 9], 0, True, 2)
    fits = choice_window([5, 6], [7], seq_len=2)
    assert (fits.score_from, fits.truncated, fits.unscored) == (1, False, 0)
    rows = [
        {"context": "t1", "choices": ["t2", "t3 t3 t3"], "gold": 0},  # 4 tokens > a row of 3
        {"context": "t1", "choices": ["t2", "t4"], "gold": 1},
    ]
    task = load_task(_jsonl(tmp_path / "long.jsonl", rows))
    result = score_task(task, id_tokenizer(8), _target_logprob, seq_len=2, batch_size=2)
    # the long choice: inputs [t3, t3], targets [t3, t3] both scored (its first t3 was cut)
    np.testing.assert_allclose(result.loglikelihoods, [(-0.3, -0.8), (-0.3, -0.5)], rtol=1e-6)
    m = result.metrics
    assert (m["examples"], m["truncated"], m["continuations_cut"]) == (2, 1, 1)
    assert m["acc"] == 0.5
    note = format_table([result]).splitlines()[-1]
    assert note.startswith("note: long: 1 choice(s) longer than a row were scored on their last")


def test_eval_output_in_a_missing_directory_is_refused_before_scoring(tmp_path, capsys):
    task = _jsonl(tmp_path / "mc.jsonl", [{"context": "a", "choices": ["b", "c"], "gold": 0}])
    out = tmp_path / "missing" / "results.json"
    argv = ["eval", str(tmp_path / "no-run"), "--tasks", str(task), "-o", str(out)]
    assert main(argv) == 2  # the -o error, not "no run": checked before the run is read
    err = capsys.readouterr().err.strip()
    assert err == f"error: -o {str(out)!r}: the directory {str(out.parent)!r} does not exist " \
        "(checked before scoring)"  # fmt: skip
    assert not out.parent.exists()


def test_choices_stored_with_their_leading_space_get_no_second_one(tmp_path, capsys):
    """lm-eval-style endings (" yes") are scored as " yes", as the plain form "yes" is, with one
    warning line per task; a non-space delimiter is still added."""
    from nvfp4_train.data import ByteTokenizer

    plain = [{"context": "Is it?", "choices": ["yes", "no"], "gold": 0}] * 2
    spaced = [{"context": "Is it?", "choices": [" yes", " no"], "gold": 0},
              {"context": "Is it?", "choices": ["yes", "\tno"], "gold": 0}]  # fmt: skip
    tok = ByteTokenizer()
    scores = {}
    for name, rows in (("plain", plain), ("spaced", spaced)):
        task = load_task(_jsonl(tmp_path / f"{name}.jsonl", rows))
        scores[name] = score_task(task, tok, _target_logprob, seq_len=32, batch_size=4)
    assert scores["spaced"].loglikelihoods[0] == scores["plain"].loglikelihoods[0]
    spaced_task = load_task(tmp_path / "spaced.jsonl")
    assert [spaced_task.continuation(c) for c in ("yes", " yes", "\tno")] == [
        " yes",
        " yes",
        "\tno",
    ]
    assert spaced_task.warnings() == [
        f"warning: {tmp_path / 'spaced.jsonl'}: 3 choice(s) start with whitespace; the "
        "delimiter ' ' is not added before them (no doubled space)"
    ]
    assert load_task(tmp_path / "plain.jsonl").warnings() == []
    assert main(["eval", str(tmp_path / "no-run"), "--tasks", str(tmp_path / "spaced.jsonl")]) == 2
    assert capsys.readouterr().out.strip() == spaced_task.warnings()[0]  # said before the run
    _jsonl(tmp_path / "d.jsonl", [{"q": "Is it", "c": [" yes", " no"]}])
    colon = _write(tmp_path / "colon.yaml", "dataset_path: json\ndata_files: d.jsonl\n"
                   "doc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\ntarget_delimiter: ':'\n")  # fmt: skip
    colon_task = load_task(colon)
    assert colon_task.continuation(" yes") == ": yes" and colon_task.warnings() == []
