"""Downstream tasks: reading task files, refusing bad ones, the scoring math against hand
computations with a fake log-probability function, and a tiny run scored end to end (in the loop
and by `nvfp4-train eval --tasks`), its per-example log-likelihoods equal to the training loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nvfp4_train.cli import main
from nvfp4_train.data import ByteTokenizer, id_tokenizer
from nvfp4_train.tasks import (
    MULTIPLE_CHOICE,
    ROLLING,
    TaskError,
    choice_window,
    encode_pair,
    load_task,
    mean_stderr,
    multiple_choice_metrics,
    rolling_windows,
    score_task,
)
from nvfp4_train.tasks.scoring import word_count

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "tasks"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _jsonl(path: Path, rows: list) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _target_logprob(inputs_BxL: np.ndarray, targets_BxL: np.ndarray):
    """A fake model: log p(target) = -0.1 * (target + 1), whatever the context; greedy iff
    the target is even."""
    del inputs_BxL
    return (-0.1 * (targets_BxL + 1)).astype(np.float32), targets_BxL % 2 == 0


# ------------------------------------------------------------------------------ reading files


def test_shipped_examples_read():
    kinds = {
        "next_word.jsonl": (MULTIPLE_CHOICE, 24),
        "lm_eval_style/questions.yaml": (MULTIPLE_CHOICE, 20),
        "bigbench_style/task.json": (MULTIPLE_CHOICE, 16),
        "passage.txt": (ROLLING, 1),
    }
    for name, (kind, n) in kinds.items():
        task = load_task(EXAMPLES / name)
        assert (task.kind, len(task)) == (kind, n), name
    yaml_task = load_task(EXAMPLES / "lm_eval_style/questions.yaml")
    first = yaml_task.examples[0]
    assert yaml_task.name == "kjv_questions"
    assert first.context == "Question: Who built the ark?\nAnswer:"
    assert first.choices[first.gold] == "Noah"
    bigbench = load_task(EXAMPLES / "bigbench_style/task.json")
    assert bigbench.name == "proverb_completion" and bigbench.delimiter == ""
    assert bigbench.examples[0].context == "The lamb follows the "
    assert bigbench.examples[0].choices[bigbench.examples[0].gold] == "shepherd"


def test_lm_eval_yaml_forms(tmp_path):
    rows = [{"q": "2+2?", "opts": {"text": ["3", "4"]}, "answer": "4", "n": 1}]
    _jsonl(tmp_path / "d.jsonl", rows)
    base = "dataset_path: json\ndataset_kwargs: {data_files: d.jsonl}\n"
    spec = base + "doc_to_text: q\ndoc_to_choice: '{{ opts.text }}'\ndoc_to_target: answer\n"
    task = load_task(_write(tmp_path / "a.yaml", spec))
    assert task.name == "a" and task.delimiter == " "
    assert task.examples[0].context == "2+2?" and task.examples[0].choices == ("3", "4")
    assert task.examples[0].gold == 1  # a target that is a choice's text
    spec = base + "doc_to_text: 'Q: {{q}} A:'\ndoc_to_choice: [nope, yep]\ndoc_to_target: '{{n}}'\n"
    spec += "target_delimiter: ''\ndata_files: ignored.jsonl\n"
    task = load_task(_write(tmp_path / "b.yaml", spec))
    example = task.examples[0]
    assert (example.context, example.choices, example.gold) == ("Q: 2+2? A:", ("nope", "yep"), 1)
    assert task.delimiter == ""
    rolling = base + "output_type: loglikelihood_rolling\ndoc_to_target: '{{q}}'\n"
    assert load_task(_write(tmp_path / "c.yaml", rolling)).documents == ("2+2?",)


def test_bigbench_defaults(tmp_path):
    spec = {"examples": [{"input": "1+1=", "target_scores": {"2": 1, "3": 0}}]}
    task = load_task(_write(tmp_path / "adding" / "task.json", json.dumps(spec)))
    assert task.name == "adding"
    assert task.examples[0].context == "\nQ: 1+1=\n  choice: 2\n  choice: 3\nA: "
    assert task.examples[0].gold == 0


BAD_FILES = {
    "missing.jsonl": ('{"context": "a", "choices": ["x", "y"]}\n', r"missing\.jsonl:1: .*'gold'"),
    "range.jsonl": (
        '\n{"context": "a", "choices": ["x", "y"], "gold": 2}\n',
        r"range\.jsonl:2: gold index 2 out of range for 2 choices",
    ),
    "empty.jsonl": ("\n\n", r"empty\.jsonl: the task has no examples"),
    "notjson.jsonl": ("{nope\n", r"notjson\.jsonl:1: not JSON"),
    "fn.yaml": ("dataset_path: json\ndoc_to_text: !function utils.doc\n", r"fn\.yaml: .*!function"),
    "gen.yaml": (
        "dataset_path: json\ndata_files: d.jsonl\noutput_type: generate_until\n",
        r"gen\.yaml: unsupported feature: output_type 'generate_until'",
    ),
    "filters.yaml": (
        "dataset_path: json\nfilter_list: []\n",
        r"filters\.yaml: unsupported feature: 'filter_list'",
    ),
    "hub.yaml": ("dataset_path: hellaswag\n", r"hub\.yaml: unsupported feature: dataset_path"),
    "control.yaml": (
        "dataset_path: json\ndata_files: d.jsonl\ndoc_to_text: '{% if q %}x{% endif %}'\n"
        "doc_to_choice: [a, b]\ndoc_to_target: 0\n",
        r"control\.yaml .*Jinja control block",
    ),
    "filter.yaml": (
        "dataset_path: json\ndata_files: d.jsonl\ndoc_to_text: '{{ q | upper }}'\n"
        "doc_to_choice: [a, b]\ndoc_to_target: 0\n",
        r"filter\.yaml .*Jinja expression",
    ),
    "tie.json": (
        json.dumps({"examples": [{"input": "x", "target_scores": {"a": 1, "b": 1}}]}),
        r"tie\.json: example 0: 2 choices share the top target_score",
    ),
    "task.csv": ("a,b\n", r"task\.csv: unknown kind of task file '\.csv'"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_task_files(tmp_path, name):
    text, message = BAD_FILES[name]
    _jsonl(tmp_path / "d.jsonl", [{"q": "x"}])
    with pytest.raises(TaskError, match=message) as raised:
        load_task(_write(tmp_path / name, text))
    assert "\n" not in str(raised.value)


def test_cli_bad_task_is_one_line(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", '{"context": "a", "choices": ["x"], "gold": 0}\n')
    assert main(["eval", str(tmp_path / "no-run"), "--tasks", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "bad.jsonl:1: needs at least 2 choices" in err
    assert len(err.splitlines()) == 1


# ------------------------------------------------------------------------------ scoring math


def test_windows_truncate_from_the_left_and_roll():
    w = choice_window([1, 2, 3, 4, 5], [6, 7], seq_len=4)
    assert (w.tokens.tolist(), w.score_from, w.truncated) == ([3, 4, 5, 6, 7], 2, True)
    assert not choice_window([1], [2], seq_len=4).truncated
    windows = rolling_windows(list(range(10)), seq_len=4)
    got = [(w.tokens.tolist(), w.score_from) for w in windows]
    assert got == [([0, 1, 2, 3, 4], 0), ([4, 5, 6, 7, 8], 0), ([5, 6, 7, 8, 9], 3)]
    scored = [t for w in windows for t in w.tokens[1 + w.score_from :].tolist()]
    assert scored == list(range(1, 10))  # every token but the first, once


def test_encode_pair_moves_trailing_space():
    tok = ByteTokenizer()
    assert encode_pair(tok.encode, "ab ", "c") == ([97, 98], [32, 99])


def test_multiple_choice_by_hand(tmp_path):
    # t-ids: log p = -0.1 (id + 1) per continuation token.
    rows = [
        {"context": "t1 t2", "choices": ["t3", "t9 t9"], "gold": 1},  # -0.4 vs -2.0: acc 0
        {"context": "t1", "choices": ["t5", "t0 t0"], "gold": 1},  # -0.6 vs -0.2: acc 1
        {"context": "t4", "choices": ["t2", "t1 t1"], "gold": 1},  # -0.3 vs -0.4: acc 0
    ]
    task = load_task(_jsonl(tmp_path / "mc.jsonl", rows))
    result = score_task(task, id_tokenizer(16), _target_logprob, seq_len=8, batch_size=4)
    expect = [(-0.4, -2.0), (-0.6, -0.2), (-0.3, -0.4)]
    np.testing.assert_allclose(np.asarray(result.loglikelihoods), expect, rtol=1e-6)
    # acc_norm divides by the choice's bytes (2 vs 5 each): -0.2 vs -0.4 (wrong), -0.3 vs -0.04
    # (right), -0.15 vs -0.08 (right)
    m = result.metrics
    assert m["acc"] == pytest.approx(1 / 3) and m["acc_norm"] == pytest.approx(2 / 3)
    p = 1 / 3
    assert m["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) * 3 / 2) / math.sqrt(3))
    assert (m["examples"], m["truncated"]) == (3, 0)
    short = score_task(task, id_tokenizer(16), _target_logprob, seq_len=2, batch_size=4)
    assert short.metrics["truncated"] == 1  # rows of 3 tokens: only "t1 t2 t9 t9" is cut
    assert short.loglikelihoods == result.loglikelihoods  # the fake ignores its context


def test_metric_formulas():
    assert mean_stderr([1.0]) is None
    assert mean_stderr([0.0, 1.0]) == pytest.approx(0.5)
    ties = multiple_choice_metrics([[-1.0, -1.0]], [1], [[1, 1]])
    assert ties["acc"] == 0.0  # ties go to the first choice
    assert word_count("a  b\nc") == 3


def test_rolling_by_hand(tmp_path):
    text = "t3 t1 t4 t1 t5 t9 t2"
    task = load_task(_write(tmp_path / "doc.txt", text))
    result = score_task(task, id_tokenizer(16), _target_logprob, seq_len=3, batch_size=2)
    ll = -0.1 * sum(i + 1 for i in (1, 4, 1, 5, 9, 2))  # no eos: the first token is context
    m = result.metrics
    assert m["loglikelihood"] == pytest.approx(ll) and m["tokens"] == 6
    assert m["perplexity"] == pytest.approx(math.exp(-ll / 6))
    assert m["word_perplexity"] == pytest.approx(math.exp(-ll / 7))
    assert m["byte_perplexity"] == pytest.approx(math.exp(-ll / len(text)))
    assert m["bits_per_byte"] == pytest.approx(-ll / len(text) / math.log(2))
    byte_result = score_task(task, ByteTokenizer(), _target_logprob, seq_len=8, batch_size=2)
    assert byte_result.metrics["tokens"] == len(text)  # after the eos, every byte is scored


def test_unscorable_examples_are_named(tmp_path):
    rows = [{"context": "t1", "choices": ["t2", "t3 t3 t3"], "gold": 0}]
    task = load_task(_jsonl(tmp_path / "long.jsonl", rows))
    with pytest.raises(TaskError, match=r"long\.jsonl:1: choice 't3 t3 t3' is 3 tokens"):
        score_task(task, id_tokenizer(8), _target_logprob, seq_len=2, batch_size=2)
    rows = [{"context": "", "choices": ["t2", "t3"], "gold": 0}]
    task = load_task(_jsonl(tmp_path / "noctx.jsonl", rows))
    with pytest.raises(TaskError, match=r"noctx\.jsonl:1: empty context"):
        score_task(task, id_tokenizer(8), _target_logprob, seq_len=4, batch_size=2)
