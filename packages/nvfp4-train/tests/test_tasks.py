"""Downstream tasks: reading task files, refusing bad ones, the scoring math against hand
computations with a fake log-probability function, and a tiny run scored end to end (in the loop
and by `nvfp4-train eval --tasks`), its per-example log-likelihoods equal to the training loss."""

from __future__ import annotations

import io
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
    "nodata.yaml": (
        "dataset_path: json\ndata_files: gone.jsonl\n",
        r"nodata\.yaml: data file 'gone",
    ),
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
    # (a choice longer than a row is scored on its last tokens: test_task_inputs.py)
    rows = [{"context": "", "choices": ["t2", "t3"], "gold": 0}]
    task = load_task(_jsonl(tmp_path / "noctx.jsonl", rows))
    with pytest.raises(TaskError, match=r"noctx\.jsonl:1: empty context"):
        score_task(task, id_tokenizer(8), _target_logprob, seq_len=4, batch_size=2)


# ------------------------------------------------------------------------------ a tiny run


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, tiny_config):
    """A 4-step run of the tiny config with its one block quantized (NVFP4) and `eval.tasks` (a
    multiple-choice JSONL and a text) scored at steps 2 and 4; checkpoint at 4."""
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.training.run import run

    root = tmp_path_factory.mktemp("scored")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(5):
        context = " ".join(f"t{t}" for t in rng.integers(0, 64, 3 + 9 * i))  # up to 39 tokens
        choices = [" ".join(f"t{t}" for t in rng.integers(0, 64, 1 + c)) for c in range(3)]
        rows.append({"context": context, "choices": choices, "gold": i % 3})
    mc = _jsonl(root / "mc.jsonl", rows)
    text = _write(root / "doc.txt", " ".join(f"t{t}" for t in rng.integers(0, 64, 70)))
    cfg = tiny_config(
        root / "run",
        precision={"bf16_first_layers": 0, "bf16_last_layers": 0},
        train={"steps": 4, "eval_every": 2},
        checkpoint={"every_steps": 4},
        eval={"tasks": [str(mc), str(text)], "batch_size": 4},
    )
    run(config_from_dict(cfg), stream=io.StringIO())
    return root / "run", mc, text


def test_loop_rows_hold_task_metrics(scored_run):
    from nvfp4_train.observe.metrics import read_metrics

    run_dir, _, _ = scored_run
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "task/mc/acc" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert 0 <= row["task/mc/acc"] <= 1 and row["task/mc/examples"] == 5
        assert row["task/mc/truncated"] == 3  # contexts of 39 tokens + a choice > 32 + 1
        assert row["task/doc/tokens"] == 69 and row["task/doc/perplexity"] > 1
        assert "val_loss" in row
    assert rows[0]["task/doc/loglikelihood"] != rows[1]["task/doc/loglikelihood"]


def test_cli_scores_like_the_loop_and_the_training_loss(scored_run, tmp_path, capsys):
    """`eval --tasks` of the step-4 checkpoint: the loop's numbers at step 4; each choice's
    log-likelihood is minus the training loss (`optax` cross-entropy of `step.forward`) summed
    over its continuation tokens, with the batches laid out by hand, exactly."""
    import jax
    import optax

    from nvfp4_train.observe.metrics import read_metrics
    from nvfp4_train.training.downstream import logprob_function
    from nvfp4_train.training.evaluation import eval_graphdef, newest_state
    from nvfp4_train.training.session import load_run_config, with_data
    from nvfp4_train.training.step import forward

    run_dir, mc, text = scored_run
    out = tmp_path / "results.json"
    assert main(["eval", str(run_dir), "--tasks", str(mc), str(text), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mc" in printed and "acc_norm" in printed and "bits_per_byte" in printed
    document = json.loads(out.read_text())
    assert (document["step"], document["forward"], document["seq_len"]) == (4, "run", 32)
    loop_row = [r for r in read_metrics(run_dir / "metrics.jsonl") if "task/mc/acc" in r][-1]
    for task in ("mc", "doc"):
        for metric, value in document["tasks"][task].items():
            if isinstance(value, float):
                assert loop_row[f"task/{task}/{metric}"] == value, (task, metric)
    assert main(["eval", str(run_dir), "--tasks", str(mc), "-o", str(out)]) == 2  # kept
    assert "exists" in capsys.readouterr().err

    cfg, datasets = with_data(load_run_config(run_dir))
    graphdef, restored = newest_state(cfg, run_dir, io.StringIO())
    model = eval_graphdef(cfg, graphdef, "run", restored.step)
    params, tok = restored.state.params, datasets.tokenizer
    task = load_task(mc)
    result = score_task(task, tok, logprob_function(model, params, seed=cfg.train.seed),
                        seq_len=32, batch_size=4)  # fmt: skip
    assert result.metrics["acc"] == document["tasks"]["mc"]["acc"]

    @jax.jit
    def token_losses(inputs, targets):
        logits = forward(model, params, inputs, jax.random.key(cfg.train.seed))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

    requests = [(e, c) for e in task.examples for c in e.choices]
    expected = []
    for first in range(0, len(requests), 4):
        inputs, targets, spans = np.zeros((4, 32), np.int32), np.zeros((4, 32), np.int32), []
        for row, (example, choice) in enumerate(requests[first : first + 4]):
            context = tok.encode(example.context)
            tokens = (context + tok.encode(choice))[-33:]  # cut from the left
            n = len(tokens) - 1
            inputs[row, :n], targets[row, :n] = tokens[:-1], tokens[1:]
            spans.append((n - len(tok.encode(choice)), n))
        losses = np.asarray(token_losses(inputs, targets))
        expected += [-np.sum(losses[r, a:b].astype(np.float64)) for r, (a, b) in enumerate(spans)]
    got = [ll for lls in result.loglikelihoods for ll in lls]
    assert got == expected  # exactly

    bf16 = score_task(task, tok, logprob_function(eval_graphdef(cfg, graphdef, "bf16", 4), params,
                      seed=cfg.train.seed), seq_len=32, batch_size=4)  # fmt: skip
    assert bf16.loglikelihoods != result.loglikelihoods  # the block's forward is quantized
    np.testing.assert_allclose(bf16.loglikelihoods[0], result.loglikelihoods[0], rtol=0.2)


def test_request_scorer_and_lm_eval_adapter(scored_run):
    """lm-eval style requests give the task files' numbers (`RequestScorer`); with lm-eval
    installed, its `nvfp4` model (`lm_eval_model`) gives the same through lm-eval's API."""
    from nvfp4_train.training.downstream import RequestScorer, run_scorer

    run_dir, mc, text = scored_run
    scorer = run_scorer(run_dir, stream=io.StringIO())
    task, document = load_task(mc), load_task(text)
    pairs = [(e.context, " " + c) for e in task.examples for c in e.choices]
    expected = score_task(task, scorer.tokenizer, scorer.logprob_fn, seq_len=32, batch_size=4)
    got = RequestScorer(scorer, batch_size=4).loglikelihood(pairs)
    assert [ll for ll, _ in got] == [ll for lls in expected.loglikelihoods for ll in lls]
    rolling = RequestScorer(scorer, batch_size=4).loglikelihood_rolling(document.documents)
    doc_result = score_task(document, scorer.tokenizer, scorer.logprob_fn, seq_len=32, batch_size=4)
    assert rolling == list(doc_result.loglikelihoods)

    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed (the eval extra)")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from nvfp4_train.lm_eval_model import register

    model = get_model("nvfp4") if register() else None
    lm = model.create_from_arg_string(f"run={run_dir},batch_size=4")
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    assert lm.loglikelihood(requests) == got
    docs = [Instance("loglikelihood_rolling", {}, (d,), 0) for d in document.documents]
    assert lm.loglikelihood_rolling(docs) == rolling
    with pytest.raises(NotImplementedError, match="generate_until"):
        lm.generate_until([])


def test_bad_eval_task_stops_the_run_before_anything_is_written(tmp_path, tiny_config):
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.training.run import run

    bad = _jsonl(tmp_path / "bad.jsonl", [{"context": "t1", "choices": ["t2", "t3"], "gold": 5}])
    cfg = config_from_dict(tiny_config(tmp_path / "run", eval={"tasks": [str(bad)]}))
    with pytest.raises(TaskError, match=r"bad\.jsonl:1: gold index 5 out of range"):
        run(cfg, stream=io.StringIO())
    assert not (tmp_path / "run").exists()
