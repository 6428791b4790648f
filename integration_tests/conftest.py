"""Test order for pytest-xdist: the longest files first (see `pytest_collection_modifyitems`)."""

from __future__ import annotations

LONGEST_FIRST = (
    "test_docs_commands.py", "test_docs_quickstart.py", "test_export_roundtrip.py",
    "test_continue_from_hf.py", "test_moe_roundtrip.py", "test_hf_import.py",
    "test_evidence_report.py", "test_evidence_gradients.py", "test_hf_moe_import.py",
    "test_lm_eval_agreement.py",
)  # fmt: skip
"""The test files that take longest (minutes of training and exporting), longest first."""


def pytest_collection_modifyitems(items):
    """Longest files first: pytest-xdist hands out whole files in collection order (noxfile's
    `--no-loadscope-reorder`), and a long file that starts last leaves the other workers idle."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
