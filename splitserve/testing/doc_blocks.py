"""The fenced code blocks of the repository's Markdown, as the docs test runs them.

The rule the docs test (tests/integration/docs/test_docs_examples.py) holds every Markdown
file to: each fenced block names its language, and each shell or Python block either runs
in the suite or is preceded by a marker that says why it cannot:

    <!-- not-run: installs packages; tests/integration/cli/test_quickstart.py runs it -->
    ```bash
    pip install ...
    ```

Parsed with markdown-it-py (CommonMark, already installed as rich's dependency), not regular
expressions: fences inside list items, longer or tilde fences and HTML comments follow
CommonMark, and each fence knows its line.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})
NOT_RUN_MARKER = re.compile(r"<!--\s*not-run:(?P<reason>.*?)-->", re.DOTALL)


@dataclass(frozen=True, slots=True)
class DocBlock:
    """One fenced block: where it is, its language (the info string's first word, "" for
    none), its text, and the reason of the not-run marker right before it (None: no marker)."""

    path: str            # relative to the repository root
    line: int            # 1-based line of the opening fence
    language: str
    source: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL_LANGUAGES

    @property
    def is_python(self) -> bool:
        return self.language in PYTHON_LANGUAGES

    @property
    def is_code(self) -> bool:
        """A block the rule applies to: it must run or say why not."""
        return self.is_shell or self.is_python


@dataclass(frozen=True, slots=True)
class StrayMarker:
    """A not-run marker that no fenced block follows: it marks nothing."""

    path: str
    line: int


def parse_blocks(text: str, path: str) -> tuple[list[DocBlock], list[StrayMarker]]:
    """The fenced blocks of one Markdown text, and its markers that precede no block.

    A marker is an HTML comment on lines of its own (an HTML block) and marks the block that
    comes right after it; one that mentions the syntax inside backticks is text, not a marker."""
    tokens = MarkdownIt("commonmark").parse(text)
    blocks: list[DocBlock] = []
    strays: list[StrayMarker] = []
    for i, token in enumerate(tokens):
        marker = NOT_RUN_MARKER.search(token.content) if token.type == "html_block" else None
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        if marker and (following is None or following.type != "fence"):
            strays.append(StrayMarker(path, _line(token)))
        if token.type != "fence":
            continue
        before = tokens[i - 1] if i else None
        found = NOT_RUN_MARKER.search(before.content) if before and before.type == "html_block" else None
        reason = " ".join(found.group("reason").split()) if found else None
        language = token.info.split()[0] if token.info.strip() else ""
        blocks.append(DocBlock(path, _line(token), language, token.content, reason))
    return blocks, strays


def _line(token) -> int:
    return token.map[0] + 1 if token.map else 0


def markdown_files(root: Path) -> list[str]:
    """Every Markdown file git tracks under `root`, relative to it: a new doc is checked
    the day it is committed."""
    listing = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=root, capture_output=True,
                             check=True, timeout=60)
    return sorted(name for name in listing.stdout.decode().split("\0") if name)


def repository_blocks(root: Path) -> tuple[list[DocBlock], list[StrayMarker]]:
    """The blocks and stray markers of every tracked Markdown file under `root`."""
    blocks: list[DocBlock] = []
    strays: list[StrayMarker] = []
    for name in markdown_files(root):
        found, stray = parse_blocks((root / name).read_text(encoding="utf-8"), name)
        blocks += found
        strays += stray
    return blocks, strays
