"""An lm-evaluation-harness model over a run directory: `nvfp4-lm-eval --model nvfp4
--model_args run=runs/x[,forward=bf16] --tasks ...` (needs `pip install 'nvfp4-train[eval]'`).

lm-eval has no plugin entry point for models, so `nvfp4-lm-eval` registers the model `nvfp4`
and then runs lm-eval's own command line with the arguments given. `loglikelihood` and
`loglikelihood_rolling` are `training.downstream.RequestScorer`'s: the code `nvfp4-train eval
--tasks` scores with. Generation (`generate_until`) is not supported.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from nvfp4_train.training.downstream import RequestScorer, run_scorer

MODEL_NAME = "nvfp4"


@functools.cache
def lm_class() -> type:
    """The `lm_eval.api.model.LM` subclass (built once lm-eval is importable)."""
    from lm_eval.api.model import LM

    class NVFP4LM(LM):
        """`--model_args run=RUN_DIR[,forward=run|quantized|bf16][,batch_size=N]`."""

        def __init__(self, run: str, forward: str = "run", batch_size: int | str = 8,
                     **ignored) -> None:  # fmt: skip
            super().__init__()
            size = 8 if str(batch_size).startswith("auto") else int(batch_size)
            self.requests = RequestScorer(run_scorer(run, forward=forward, stream=sys.stderr), size)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.requests.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self.requests.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError(
                "the nvfp4 model scores log-likelihoods only (multiple_choice, loglikelihood, "
                "loglikelihood_rolling tasks); generate_until is not supported"
            )

    return NVFP4LM


def register() -> type:
    """Registers `lm_class()` as lm-eval's model `nvfp4` (once); returns it."""
    from lm_eval.api.registry import model_registry, register_model

    cls = lm_class()
    if MODEL_NAME not in model_registry:
        register_model(MODEL_NAME)(cls)
    return cls


def main(argv: Sequence[str] | None = None) -> None:
    """`nvfp4-lm-eval ARGS`: lm-eval's command line with the `nvfp4` model registered."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        sys.exit("error: lm-evaluation-harness is not installed: pip install 'nvfp4-train[eval]'")
    register()
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
