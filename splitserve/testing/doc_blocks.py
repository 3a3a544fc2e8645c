"""The fenced code blocks of the repository's Markdown, as the docs test runs them.

The rule the docs test (tests/integration/docs/test_docs_examples.py) holds every Markdown
file to: each fenced block names its language, and each shell or Python block either runs
here or is preceded by a marker that says why not: another test runs it (`run-by`, naming
that test), or it cannot run inside a test suite (`not-run`, saying why):

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
MARKER = re.compile(r"<!--\s*(?P<kind>not-run|run-by):(?P<reason>.*?)-->", re.DOTALL)


@dataclass(frozen=True, slots=True)
class DocBlock:
    """One fenced block: where it is, its language (the info string's first word, "" for
    none), its text, and the marker right before it: `not-run` or `run-by` and its reason
    (None, None: no marker, the docs test runs it)."""

    path: str            # relative to the repository root
    line: int            # 1-based line of the opening fence
    language: str
    source: str
    marker: str | None       # "not-run" | "run-by"
    reason: str | None

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

    @property
    def runs_here(self) -> bool:
        """A shell or Python block without a marker: the docs test runs it."""
        return self.is_code and self.marker is None


@dataclass(frozen=True, slots=True)
class StrayMarker:
    """A marker that no fenced block follows: it marks nothing."""

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
        marker = MARKER.search(token.content) if token.type == "html_block" else None
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        if marker and (following is None or following.type != "fence"):
            strays.append(StrayMarker(path, _line(token)))
        if token.type != "fence":
            continue
        before = tokens[i - 1] if i else None
        found = MARKER.search(before.content) if before and before.type == "html_block" else None
        kind, reason = (found.group("kind"), " ".join(found.group("reason").split())) if found else (None, None)
        language = token.info.split()[0] if token.info.strip() else ""
        blocks.append(DocBlock(path, _line(token), language, token.content, kind, reason))
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
