"""The errors of `model.init_from`: a Hugging Face model directory this trainer cannot start from.

Both are user errors (`ValueError`s: the CLI prints one `error:` line and exits 2). They live in
a module of their own so that every import module (`hf_config`, `hf_weights`, `hf_moe`) raises
them without importing another.
"""

from __future__ import annotations


class HFConfigError(ValueError):
    """A Hugging Face model directory this trainer cannot start from (the config loader reports
    it as a `ConfigError`)."""


class HFImportError(HFConfigError):
    """Weights of a Hugging Face model directory that cannot be imported (named with the reason):
    a user error like the directory's other problems (one `error:` line, exit 2)."""
