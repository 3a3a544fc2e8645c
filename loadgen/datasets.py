"""Workloads read from files: the Mooncake trace format and ShareGPT-style JSON.

Mooncake (kvcache-ai/Mooncake FAST'25 traces): one JSON object per line with
`timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id per
512-token block of the prompt; two requests share a block's content exactly
when they share its id at the same position. Replay keeps that property: each
block's words are drawn from a generator seeded by its hash id, so equal ids give
equal tokens and different ids (almost surely) different ones. The production
lengths (12k-token prompts on average) are too long for small CPU models, so
lengths are scaled down by mapping a 512-token block to `block_tokens` tokens,
outputs by `output_scale`, and time by `time_scale`; every report states the
scaling (`Workload.notes`). The FAST'25 conversation trace ships in data/mooncake/
(Apache-2.0, unmodified, attribution beside it) and is the default; --trace or
$SPLITSERVE_MOONCAKE_TRACE names another.

ShareGPT: a JSON list of `{"conversations": [{"from": "human"|"user", "value": ...},
{"from": "gpt"|"assistant", "value": ...}, ...]}`. The human messages are the
prompts (real text, counted with the model's tokenizer); each reply's token
count is the output length asked for.
"""

from __future__ import annotations

import json
import os
import random
from importlib import resources
from pathlib import Path

from splitserve.errors import SplitserveError

from splitserve.loadgen.tokens import PromptVocab
from splitserve.loadgen.workloads import Conversation, Turn, Workload

MOONCAKE_BLOCK_TOKENS = 512
TRACE_ENV = "SPLITSERVE_MOONCAKE_TRACE"
# The trace ships inside the package (data/mooncake/, with its Apache-2.0 attribution),
# declared as package data in pyproject.toml so a wheel carries it too.
SHIPPED_TRACE = ("data", "mooncake", "conversation_trace.jsonl")
_HUMAN_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


def shipped_trace_path() -> Path:
    """The Mooncake conversation trace installed with splitserve.loadgen."""
    # Installed packages are plain folders (wheels are unpacked; the editable install maps
    # loadgen/), so the resource is a real file and a Path is what the readers expect.
    return Path(str(resources.files(__package__).joinpath(*SHIPPED_TRACE)))


def default_trace_path() -> Path:
    """$SPLITSERVE_MOONCAKE_TRACE when set, else the shipped trace."""
    configured = os.environ.get(TRACE_ENV)
    return Path(configured).expanduser() if configured else shipped_trace_path()


def _require_file(path: Path, what: str, hint: str) -> Path:
    if not path.is_file():
        raise SplitserveError(f"{what} not found at {path}; {hint}")
    return path


def _block_words(vocab: PromptVocab, hash_id: int, block_tokens: int, seed: int):
    return vocab.draw(random.Random(f"mooncake:{seed}:{hash_id}"), block_tokens)


def mooncake_trace(vocab: PromptVocab, path: Path | None = None, *, num_requests: int | None = None,
                   start: int = 0, block_tokens: int = 16, output_scale: float | None = None,
                   max_output_tokens: int = 256, max_input_tokens: int | None = None, time_scale: float = 1.0,
                   conversations: int | None = None, min_turns: int = 3, seed: int = 0) -> Workload:
    """Replay `num_requests` records of a Mooncake trace from index `start`, scaled down; a scaled
    prompt longer than `max_input_tokens` keeps its first that many tokens (its shared prefix).
    With `conversations`, only the records of the first that many conversations of at least
    `min_turns` turns (conversation_records), in trace order."""
    path = Path(path) if path else default_trace_path()
    path = _require_file(path, "Mooncake trace", f"pass --trace PATH or set {TRACE_ENV}")
    if block_tokens < 1 or time_scale <= 0:
        raise SplitserveError("trace replay needs block_tokens >= 1 and time_scale > 0")
    if max_input_tokens is not None and max_input_tokens < 1:
        raise SplitserveError(f"--trace-max-input {max_input_tokens}: give at least 1 token")
    scale = block_tokens / MOONCAKE_BLOCK_TOKENS
    out_scale = scale if output_scale is None else output_scale
    if conversations is None:
        records = _read_jsonl(path, start, num_requests)
        indices = list(range(start, start + len(records)))
    else:
        indices, records = conversation_records(_read_jsonl(path, start, None), conversations, min_turns)
        indices, records = [start + i for i in indices][:num_requests], records[:num_requests]
    t0 = records[0]["timestamp"] if records else 0
    replayed, cut = [], 0
    for index, rec in zip(indices, records):
        num_tokens = scaled_input_tokens(rec, scale, max_input_tokens)
        cut += num_tokens < max(1, round(rec["input_length"] * scale))
        hash_ids = list(rec["hash_ids"]) or [f"r{index}"]
        words = []
        for hash_id in hash_ids:
            if len(words) >= num_tokens:
                break
            words.extend(_block_words(vocab, hash_id, block_tokens, seed))
        while len(words) < num_tokens:     # rounding left the chain short: a private tail block
            words.extend(_block_words(vocab, f"tail:{index}:{len(words)}", block_tokens, seed))
        words = words[:num_tokens]
        if not vocab.check(words):
            raise SplitserveError(f"trace request {index}: its prompt does not round-trip through "
                                  "the tokenizer; try another --seed")
        max_tokens = max(1, min(max_output_tokens, round(rec["output_length"] * out_scale)))
        replayed.append(Conversation(f"trace{index}", [Turn(vocab.text(words), num_tokens, max_tokens)],
                                          arrival_s=(rec["timestamp"] - t0) / 1000.0 * time_scale))
    which = (f"requests {start}..{start + len(records) - 1}" if conversations is None else
             f"the {len(records)} requests of the first {conversations} conversations of {min_turns}+ turns "
             f"from request {start}")
    note = (f"Mooncake trace {path.name} replayed scaled down: {which}; "
            f"a 512-token block became {block_tokens} tokens (input x{scale:g}), output x{out_scale:g} "
            f"capped at {max_output_tokens}, time x{time_scale:g}"
            + (f"; {cut} prompt(s) cut to their first {max_input_tokens} tokens" if cut else ""))
    params = {"path": str(path), "start": start, "num_requests": len(records), "block_tokens": block_tokens,
              "conversations": conversations, "min_turns": min_turns if conversations is not None else None,
              "input_scale": scale, "output_scale": out_scale, "max_output_tokens": max_output_tokens,
              "max_input_tokens": max_input_tokens, "prompts_cut": cut,
              "time_scale": time_scale, "seed": seed}
    return Workload("trace", replayed, params, [note], cyclic=False)


def scaled_input_tokens(rec: dict, scale: float, max_input_tokens: int | None) -> int:
    """A trace record's prompt length replayed at `scale` tokens per trace token, cut to `max_input_tokens`."""
    n = max(1, round(rec["input_length"] * scale))
    return n if max_input_tokens is None else min(n, max_input_tokens)


def read_trace(path: Path) -> list[dict]:
    """Every record of a Mooncake trace file, checked."""
    return _read_jsonl(path, 0, None)


def conversation_records(records: list[dict], conversations: int, min_turns: int) -> tuple[list[int], list[dict]]:
    """The records (and their indices) of the first `conversations` conversations with at least
    `min_turns` turns. A conversation is the records that share their first two blocks: every
    request of the FAST'25 conversation trace starts with the same block (the system prompt), and
    a later turn repeats its conversation's earlier turns. Its turns lie minutes apart in the
    trace, so a window of consecutive records shares little (3-8 % of blocks in 96-200 records,
    37 % over the whole hour); this keeps the trace's own turns and order, densely."""
    if conversations < 1 or min_turns < 1:
        raise SplitserveError("trace conversations: give at least 1 conversation of at least 1 turn")
    turns: dict[tuple, list[int]] = {}
    for i, rec in enumerate(records):
        if len(rec["hash_ids"]) >= 2:
            turns.setdefault(tuple(rec["hash_ids"][:2]), []).append(i)
    chosen = [members for members in turns.values() if len(members) >= min_turns][:conversations]
    if not chosen:
        raise SplitserveError(f"the trace has no conversation of {min_turns}+ turns (records sharing their "
                              "first two blocks)")
    indices = sorted(i for members in chosen for i in members)
    return indices, [records[i] for i in indices]


def _read_jsonl(path: Path, start: int, limit: int | None) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            if lineno < start or not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            try:
                rec = json.loads(line)
                _ = (rec["timestamp"], rec["input_length"], rec["output_length"], rec["hash_ids"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise SplitserveError(f"{path}:{lineno + 1}: not a Mooncake trace record ({exc})") from None
            records.append(rec)
    if not records:
        raise SplitserveError(f"{path} has no records from index {start}")
    return records


def sharegpt(vocab: PromptVocab, path: Path, *, num_conversations: int | None = None, max_turns: int = 1,
             max_input_tokens: int = 1024, max_output_tokens: int = 256, min_tokens: int = 1,
             seed: int = 0) -> Workload:
    """Conversations of a ShareGPT-style file, in a seeded random order; the first
    `max_turns` (human, reply) pairs of each; those whose prompts or replies fall
    outside [min_tokens, max_*_tokens] are cut at that turn (or skipped)."""
    path = _require_file(Path(path), "ShareGPT file", "pass --dataset PATH")
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SplitserveError(f"{path} is not JSON: {exc}") from None
    if not isinstance(items, list):
        raise SplitserveError(f"{path}: expected a JSON list of conversations")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    conversations = []
    for index in order:
        if num_conversations is not None and len(conversations) >= num_conversations:
            break
        turns = _sharegpt_turns(vocab, items[index], max_turns, max_input_tokens, max_output_tokens, min_tokens)
        if turns:
            item = items[index]
            name = str(item.get("id", index)) if isinstance(item, dict) else str(index)
            conversations.append(Conversation(f"sharegpt-{name}", turns, group=name))
    if not conversations:
        raise SplitserveError(f"{path}: no conversation has a usable (human, reply) pair")
    params = {"path": str(path), "num_conversations": len(conversations), "max_turns": max_turns,
              "max_input_tokens": max_input_tokens, "max_output_tokens": max_output_tokens, "seed": seed}
    return Workload("sharegpt", conversations, params)


def _sharegpt_turns(vocab: PromptVocab, item, max_turns: int, max_in: int, max_out: int,
                    min_tokens: int) -> list[Turn]:
    messages = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(messages, list):
        return []
    turns = []
    for human, reply in zip(messages[::2], messages[1::2]):
        if len(turns) >= max_turns or not (isinstance(human, dict) and isinstance(reply, dict)):
            break
        if human.get("from") not in _HUMAN_ROLES or reply.get("from") not in _ASSISTANT_ROLES:
            break
        text, answer = str(human.get("value", "")), str(reply.get("value", ""))
        num_in, num_out = vocab.count(text), vocab.count(answer)
        if not (min_tokens <= num_in <= max_in) or num_out < min_tokens:
            break
        turns.append(Turn(text, num_in, min(num_out, max_out)))
    return turns
