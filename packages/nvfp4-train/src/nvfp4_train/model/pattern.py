"""The layer pattern of a hybrid model (`model.pattern`): which mixer each block holds.

A Llama-style model (no pattern) has one kind of block, "llama": attention, then an MLP (or the
MoE MLP), each behind its own pre-norm. A hybrid model (Nemotron-H, Nemotron 3) gives every block
ONE mixer behind one pre-norm, `x + mixer(norm(x))`, and says which in a pattern: Nemotron's
letters (`M` Mamba-2, `*` attention, `-` MLP, `E` Mixture-of-Experts), or a list of the kinds'
names. Blocks of one kind compute alike, so runs and repeating groups of them are scanned.

Example:
    >>> pattern_kinds("M-M*E")
    ('mamba', 'mlp', 'mamba', 'attention', 'moe')
    >>> pattern_kinds(("mamba", "attention"))
    ('mamba', 'attention')
    >>> pattern_letters(("mamba", "mlp", "moe"))
    'M-E'
"""

from __future__ import annotations

from collections.abc import Sequence

LLAMA = "llama"
"""The kind of every block of a model without a pattern: attention + MLP (or MoE MLP)."""
LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
"""Nemotron's pattern letters (`hybrid_override_pattern`) -> block kinds."""
KINDS = tuple(LETTERS.values())
"""The kinds of a hybrid block, each one mixer."""


def pattern_kinds(pattern: str | Sequence[str]) -> tuple[str, ...]:
    """The kind of each block: a string of letters (`LETTERS`) or a sequence of kind names.

    Raises:
        ValueError: an unknown letter or name, naming it, its position and the allowed ones.
    """
    if isinstance(pattern, str):
        for i, letter in enumerate(pattern):
            if letter not in LETTERS:
                raise ValueError(
                    f"model.pattern has the unknown letter {letter!r} at block {i}; the letters "
                    f"are {', '.join(f'{k} ({v})' for k, v in LETTERS.items())}"
                )
        return tuple(LETTERS[letter] for letter in pattern)
    for i, name in enumerate(pattern):
        if name not in KINDS:
            raise ValueError(
                f"model.pattern has the unknown block kind {name!r} at block {i}; the kinds are "
                f"{', '.join(KINDS)} (or the letters {''.join(LETTERS)})"
            )
    return tuple(pattern)


def pattern_letters(kinds: Sequence[str]) -> str:
    """The kinds of a hybrid pattern as Nemotron's letters (the inverse of `pattern_kinds`)."""
    letters = {kind: letter for letter, kind in LETTERS.items()}
    return "".join(letters[kind] for kind in kinds)
