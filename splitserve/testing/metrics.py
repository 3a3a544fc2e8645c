"""Reading Prometheus text exposition in tests: the sum of a metric's samples by label."""

from __future__ import annotations

import re
import urllib.request


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def scrape(url: str, name: str, timeout: float = 10.0, **labels: str) -> float:
    """`sample_sum` of what `url` (a /metrics endpoint) answers now."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return sample_sum(resp.read().decode(), name, **labels)
