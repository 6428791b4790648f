"""Every command a user can copy from the docs runs as written (see docs_blocks.py): here the
blocks that do not use the README's quick-start run, in reading order, and the parser itself;
test_docs_quickstart.py runs the quick start and the blocks that use its run, in parallel."""

from __future__ import annotations

import pytest
from docs_blocks import (
    BLOCKS,
    FIRST,
    REPO,
    blocks_of,
    command_line,
    console_commands,
    pip_problems,
    quick_start_chain,
    run_block,
    run_dirs,
    scratch_fixture,
    shell_commands,
)

CHAIN, REST = quick_start_chain(BLOCKS)
scratch = scratch_fixture("docs")


@pytest.mark.parametrize("block", REST, ids=[b.where for b in REST])
def test_documented_block_runs(block, scratch):
    run_block(block, scratch)


def test_the_two_lists_share_no_run_directory():
    # the quick start's list holds its run's users (a plot of runs/tiny, exports of it, ...)
    assert CHAIN[0] == BLOCKS[0] and len(CHAIN) >= 5
    made = {name for block in CHAIN for name in run_dirs(block, "runs/tiny")}
    assert "runs/tiny" in made
    for block in REST:
        assert not made & run_dirs(block, "runs/tiny"), block.where
    assert sorted([*CHAIN, *REST], key=BLOCKS.index) == BLOCKS


def test_the_docs_have_commands_to_run():
    # a parser that finds nothing would make the test above pass vacuously
    ran = [b for b in BLOCKS if not b.skip]
    assert len(ran) >= 20, [b.where for b in ran]
    assert {b.kind for b in ran} == {"bash", "python", "console"}
    assert {b.doc for b in ran} >= set(FIRST)


def test_parser_on_a_made_up_page(tmp_path):
    page = (
        "# t\n\n```bash\npip install ./packages/nvfp4-format && nvfp4-format inspect a \\\n"
        "    b  # two files\n# a comment line\nX=1 echo 'a b'; true > out.txt\n```\n\n"
        "<!-- docs-test: skip (needs a GPU) -->\n```bash\nnvidia-smi\n```\n\n"
        "```\n$ nvfp4-train run c.yaml x=1\nerror: unknown\n```\n\n```yaml\na: 1\n```\n"
    )
    blocks = blocks_of("t.md", page)
    assert [(b.kind, b.line, b.skip) for b in blocks] == [
        ("bash", 3, None),
        ("bash", 11, "needs a GPU"),
        ("console", 15, None),
    ]
    assert shell_commands(blocks[0].text) == [
        ["pip", "install", "./packages/nvfp4-format"],
        ["nvfp4-format", "inspect", "a", "b"],
        ["X=1", "echo", "a b"],
        ["true", ">", "out.txt"],
    ]
    assert command_line(["X=1", "echo", "a b", ">", "o"]) == "X=1 echo 'a b' > o"
    assert console_commands(blocks[2].text) == [("nvfp4-train run c.yaml x=1", ["error: unknown"])]
    with pytest.raises(ValueError, match="needs a reason"):
        blocks_of("t.md", "<!-- docs-test: skip -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="pipes"):
        shell_commands("ls | head")


def test_pip_checks_catch_missing_packages_and_extras():
    assert pip_problems(["nvfp4-train", "run", "x.yaml"], REPO) is None
    ok = [
        "pip",
        "install",
        "torch==2.13.0",
        "--index-url",
        "https://x/cpu",
        "./packages/nvfp4-ops[te]",
    ]
    assert pip_problems(ok, REPO) == []
    bad = ["python3", "-m", "pip", "install", "./packages/nvfp4-nope", "packages/nvfp4-export[gpu]"]
    assert pip_problems(bad, REPO) == [
        "./packages/nvfp4-nope: ./packages/nvfp4-nope is not a package of this repository",
        "packages/nvfp4-export[gpu]: packages/nvfp4-export declares no extra 'gpu'",
    ]
