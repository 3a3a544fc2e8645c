"""splitserve.testing.doc_blocks: which fenced blocks a Markdown text has, and what marks them."""

from __future__ import annotations

from splitserve.testing.doc_blocks import DocBlock, StrayMarker, parse_blocks

LIST_ITEM = """\
1. Install:

   <!-- not-run: installs
        packages -->
   ```bash
   pip install x
   ```

2. Then:

   ```python
   print(1)
   ```
"""


def test_a_marker_inside_a_list_item_marks_the_block_after_it():
    blocks, strays = parse_blocks(LIST_ITEM, "R.md")
    assert blocks == [DocBlock("R.md", 5, "bash", "pip install x\n", "not-run", "installs packages"),
                      DocBlock("R.md", 11, "python", "print(1)\n", None, None)]
    assert strays == []
    assert not blocks[0].runs_here and blocks[1].runs_here and blocks[0].id == "R.md:5"


def test_run_by_names_the_test_that_runs_the_block():
    text = "<!-- run-by: tests/a.py::test_b -->\n```sh\nls\n```\n"
    [block], _ = parse_blocks(text, "R.md")
    assert (block.marker, block.reason, block.is_shell) == ("run-by", "tests/a.py::test_b", True)


def test_fences_without_a_language_and_data_blocks_are_not_code():
    text = "```\nplain\n```\n\n~~~yaml\na: 1\n~~~\n\n````markdown\n```bash\nnested\n```\n````\n"
    blocks, _ = parse_blocks(text, "R.md")
    assert [(b.language, b.is_code) for b in blocks] == [("", False), ("yaml", False), ("markdown", False)]


def test_a_marker_with_no_block_right_after_it_is_stray():
    text = ("<!-- not-run: first -->\n<!-- not-run: second -->\n```bash\nls\n```\n\n"
            "<!-- not-run: orphan -->\n\nA paragraph.\n\n<!-- run-by: tests/x.py::y -->\n")
    blocks, strays = parse_blocks(text, "R.md")
    assert [b.reason for b in blocks] == ["second"]
    assert strays == [StrayMarker("R.md", 1), StrayMarker("R.md", 7), StrayMarker("R.md", 11)]


def test_the_marker_syntax_quoted_in_text_is_not_a_marker():
    text = "Write `<!-- not-run: why -->` before a block.\n\n```bash\nls\n```\n"
    blocks, strays = parse_blocks(text, "R.md")
    assert blocks[0].marker is None and strays == []
