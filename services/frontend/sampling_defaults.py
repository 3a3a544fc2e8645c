"""The sampling values a request gets for the parameters it leaves out.

Like vLLM's OpenAI server with `--generation-config auto` (its default), the
frontend takes the model authors' recommendations from the model folder's
`generation_config.json` (temperature, top_p, top_k, min_p, repetition_penalty) as the defaults of
a request that omits them; a value the request sets always wins. `vllm` keeps
the engine's neutral defaults (temperature 1, top_p 1, no top_k, no min_p, no
repetition penalty); a
folder path reads that folder's `generation_config.json` instead.

Only keys present (and not null) override anything, as in vLLM's
`get_diff_sampling_param`; `do_sample` is ignored there too (an OpenAI request
with no temperature samples). A key the engine cannot honour would be reported
at start-up as not applied (`not_applied`), rather than silently pretending. A file that is not a JSON object, or a value of the
wrong type or out of range, stops the frontend at start with a message naming
the file and the key: a server that quietly samples differently from what its
operator asked is worse than one that does not start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.errors import SplitserveError

MODE_AUTO = "auto"          # the model folder's generation_config.json
MODE_NEUTRAL = "vllm"       # the engine's neutral defaults; the file is ignored
FILE_NAME = "generation_config.json"

# The engine's neutral values: what a request that omits a parameter got before.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class GenerationConfigError(SplitserveError):
    """--generation-config names a missing or malformed generation_config.json."""


@dataclass(slots=True)
class SamplingDefaults:
    """Defaults for omitted sampling parameters; None: the engine's neutral value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = MODE_NEUTRAL                 # where they came from, for the start-up line
    not_applied: dict = field(default_factory=dict)   # keys the engine cannot honour

    def overrides(self) -> dict:
        """The parameters this replaces, by name (empty: the engine's neutral defaults)."""
        return {name: value for name in NEUTRAL if (value := getattr(self, name)) is not None}

    def temperature_or(self, requested: float | None) -> float:
        return _first(requested, self.temperature, NEUTRAL["temperature"])

    def top_p_or(self, requested: float | None) -> float:
        return _first(requested, self.top_p, NEUTRAL["top_p"])

    def top_k_or(self, requested: int | None) -> int:
        return _first(requested, self.top_k, NEUTRAL["top_k"])

    def min_p_or(self, requested: float | None) -> float:
        return _first(requested, self.min_p, NEUTRAL["min_p"])

    def repetition_penalty_or(self, requested: float | None) -> float:
        return _first(requested, self.repetition_penalty, NEUTRAL["repetition_penalty"])

    def startup_line(self) -> str:
        """One log line saying which defaults are in use and how to turn them off."""
        parts = []
        if self.overrides():
            shown = ", ".join(f"{k}={v}" for k, v in self.overrides().items())
            parts.append(f"default sampling parameters have been overridden by the model's generation "
                         f"config ({self.source}): {shown}; requests that set them keep their own values "
                         f"(--generation-config vllm restores the neutral defaults)")
        else:
            parts.append(f"default sampling parameters: the engine's neutral defaults ({self.source})")
        if self.not_applied:
            shown = ", ".join(f"{k}={v}" for k, v in self.not_applied.items())
            parts.append(f"not applied (the engine does not support them): {shown}")
        return "; ".join(parts)


def _first(*values):
    return next(v for v in values if v is not None)


def load_sampling_defaults(mode: str, model_generation_config: dict | None = None,
                           model_source: str = "the model folder") -> SamplingDefaults:
    """The defaults for `--generation-config MODE`.

    `model_generation_config` is the model folder's generation_config.json as the
    checkpoint read it (already parsed: a file that is not JSON failed there); it is used
    for `auto`. Any other MODE but `vllm` is a folder holding generation_config.json.
    Raises GenerationConfigError for a missing file or a malformed value.
    """
    if mode == MODE_NEUTRAL:
        return SamplingDefaults(source="--generation-config vllm")
    if mode == MODE_AUTO:
        return from_generation_config(model_generation_config or {}, f"{model_source}/{FILE_NAME}")
    path = Path(mode).expanduser()
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise GenerationConfigError(f"--generation-config {mode}: no {FILE_NAME} there (give 'auto', 'vllm' "
                                    f"or a folder that holds {FILE_NAME})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"--generation-config: cannot read {path}: {exc}") from None
    return from_generation_config(data, str(path))


def from_generation_config(data, origin: str) -> SamplingDefaults:
    """The sampling defaults of one parsed generation_config.json (`origin` names it in errors)."""
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{origin} must hold a JSON object, not {type(data).__name__}")
    defaults = SamplingDefaults(source=origin)
    defaults.temperature = _number(data, "temperature", origin, 0.0, 100.0)   # the engine's range
    defaults.top_p = _number(data, "top_p", origin, 0.0, 1.0, low_open=True)
    defaults.min_p = _number(data, "min_p", origin, 0.0, 1.0)
    top_k = data.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise GenerationConfigError(f"{origin}: top_k must be an integer >= 0 (or -1: off), got {top_k!r}")
        defaults.top_k = max(top_k, 0)      # vLLM spells "off" -1, the engine 0
    defaults.repetition_penalty = _number(data, "repetition_penalty", origin, 0.0, math.inf, low_open=True)
    return defaults


def _number(data: dict, key: str, origin: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not numeric or (value <= low if low_open else value < low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise GenerationConfigError(f"{origin}: {key} must be a number in {bounds}, got {value!r}")
    return float(value)
