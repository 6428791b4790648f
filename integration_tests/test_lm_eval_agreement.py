"""lm-evaluation-harness's own `hf` model agrees with `nvfp4-train eval --tasks --bf16`.

A tiny NVFP4 run (60 steps) is exported as a plain BF16 Hugging Face directory that transformers
loads without a quantization config (`nvfp4-export hf --layout bf16`): every linear's master
weight rounded to BF16, the weights the `--bf16` forward multiplies by (an NVFP4 export's
dequantized weights are not, and their quantization error would swamp what is compared here).
lm-eval's `HFLM` (float32) scores the shipped `next_word` task's (context, " " + choice)
requests; `evaluate_run_tasks` / `score_tasks` with the `bf16` forward score the same task.
Compared: the token split of each request (exactly), each choice's log-likelihood (within
`RELATIVE_TOLERANCE`), and the accuracy.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

for _module in ("lm_eval", "torch", "transformers", "accelerate"):
    pytest.importorskip(_module)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from nvfp4_export import export_hf  # noqa: E402
from nvfp4_export.verify import render, verify  # noqa: E402
from nvfp4_train.tasks import encode_pair, load_task  # noqa: E402
from nvfp4_train.training.downstream import (  # noqa: E402
    evaluate_run_tasks,
    run_scorer,
    score_tasks,
)

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "tasks" / "next_word.jsonl"
BATCH_SIZE = 8
RELATIVE_TOLERANCE = 1e-3
"""max |ll_hf - ll_ours| / |ll_ours| per choice. Measured 4.5e-4 (max absolute 0.011 nats on
log-likelihoods of 21.5 nats on average) after 60 steps (validation loss 2.6): our forward runs
its GEMMs on BF16 activations, transformers in float32 on the same BF16-rounded weights. HF in
bfloat16 instead: 5.3e-3 (0.096 nats); the dequantized NVFP4 export (its NVFP4 blocks' weights
not the master weights) in float32: 1.7e-3 (0.041 nats), which this tolerance tells apart."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train") / "tiny"
    cmd = [
        sys.executable, "-m", "nvfp4_train", "run", str(ROOT / "examples/configs/tiny.yaml"),
        f"output_dir={run_dir}", "train.steps=60", "train.batch_size=4", "train.seq_len=32",
        "train.eval_every=60", "checkpoint.every_steps=60", "logging.tensorboard=false",
        "logging.progress=plain",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory) -> Path:
    """The run's master weights as a plain BF16 HF directory (`--layout bf16`), checked."""
    out = export_hf(run, tmp_path_factory.mktemp("hf") / "bf16", layout="bf16").out_dir
    report = verify(out, against=run)
    assert report.ok, render(report)
    return out


@pytest.fixture(scope="module")
def ours(run):
    """(the run's bf16 `RunScorer`, the task's `TaskResult` as `eval --tasks --bf16` scores it)."""
    scorer = run_scorer(run, forward="bf16", stream=io.StringIO())
    (result,) = score_tasks([load_task(TASK)], scorer.tokenizer, scorer.logprob_fn,
                            seq_len=scorer.seq_len, batch_size=BATCH_SIZE)  # fmt: skip
    return scorer, result


@pytest.fixture(scope="module")
def lm(hf_dir):
    return HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=BATCH_SIZE, device="cpu")


def _requests(task) -> list[tuple[str, str]]:
    return [(ex.context, task.delimiter + c) for ex in task.examples for c in ex.choices]


def test_lm_eval_splits_each_request_into_our_tokens(lm, ours):
    scorer, _ = ours
    for context, continuation in _requests(load_task(TASK)):
        # lm-eval's HFLM: no BOS (add_bos_token False), context's trailing spaces moved, the
        # continuation the tokens of context + continuation past those of the context
        theirs = lm._encode_pair(context, continuation)
        assert tuple(theirs) == encode_pair(scorer.tokenizer.encode, context, continuation)


def test_lm_eval_hf_loglikelihoods_and_accuracy_match_eval_tasks_bf16(lm, ours, run):
    task = load_task(TASK)
    instances = [
        Instance(request_type="loglikelihood", doc={}, arguments=request, idx=i)
        for i, request in enumerate(_requests(task))
    ]
    theirs = np.asarray([ll for ll, _ in lm.loglikelihood(instances)], np.float64)
    _, result = ours
    mine = np.concatenate([np.asarray(lls, np.float64) for lls in result.loglikelihoods])
    assert theirs.shape == mine.shape == (sum(len(ex.choices) for ex in task.examples),)
    relative = np.abs(theirs - mine) / np.abs(mine)
    assert relative.max() <= RELATIVE_TOLERANCE, (relative.max(), np.abs(theirs - mine).max())
    picks, start = [], 0
    for ex in task.examples:
        stop = start + len(ex.choices)
        picks.append((int(np.argmax(theirs[start:stop])), int(np.argmax(mine[start:stop]))))
        start = stop
    assert [a for a, _ in picks] == [b for _, b in picks]
    acc = np.mean([a == ex.gold for (a, _), ex in zip(picks, task.examples, strict=True)])
    document = evaluate_run_tasks(run, [TASK], forward="bf16", batch_size=BATCH_SIZE,
                                  stream=io.StringIO())  # fmt: skip
    assert document["tasks"][task.name]["acc"] == result.metrics["acc"] == acc
