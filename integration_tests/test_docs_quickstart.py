"""The README's quick start and every documented block that uses its run (runs/tiny, and the
runs made from it), in reading order in one scratch directory (see docs_blocks.py); the other
blocks run in test_docs_commands.py, in parallel with these."""

from __future__ import annotations

import pytest
from docs_blocks import BLOCKS, quick_start_chain, run_block, scratch_fixture

CHAIN, _ = quick_start_chain(BLOCKS)
scratch = scratch_fixture("docs-quickstart")


@pytest.mark.parametrize("block", CHAIN, ids=[b.where for b in CHAIN])
def test_documented_block_runs(block, scratch):
    run_block(block, scratch)
