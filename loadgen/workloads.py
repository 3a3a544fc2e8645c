"""Workloads: what each request asks for, decided before the run starts.

Every workload is a list of `Conversation`s, each one or more `Turn`s. A
single-turn workload (synthetic, shared-prefix, trace, ShareGPT by default) has
one-turn conversations; a multi-turn chat session has several, and the runner
sends turn k+1 only after turn k's answer came back, with the earlier turns and
answers in its prompt. So one shape serves every workload and the runner has no
per-workload code.

Turns carry their new user text and its exact token count (built from stable
words of the model's tokenizer, `tokens.PromptVocab`), and `max_tokens`, the
output length asked for. Generation is seeded: the same arguments give the same
prompts. The Mooncake trace and ShareGPT files are read in `datasets.py`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from splitserve.errors import SplitserveError

from splitserve.loadgen.tokens import PromptVocab


@dataclass(slots=True)
class Turn:
    text: str             # the new user content of this turn
    num_tokens: int       # its token count, encoded on its own without special tokens
    max_tokens: int       # output tokens asked for


@dataclass(slots=True)
class Conversation:
    conversation_id: str
    turns: list[Turn]
    arrival_s: float | None = None      # scheduled start, for trace-schedule arrivals
    group: str | None = None            # tenant or session label, for reports


@dataclass(slots=True, frozen=True)
class LengthDist:
    """A token-length distribution: `N`, `uniform:LO:HI`, `normal:MEAN:STD` or `exp:MEAN` (all ≥ 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> "LengthDist":
        parts = str(text).strip().split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            kind, values = parts[0], [float(v) for v in parts[1:]]
        except ValueError:
            raise SplitserveError(f"bad length {text!r}: use N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN") from None
        arity = {"uniform": 2, "normal": 2, "exp": 1}
        if kind not in arity or len(values) != arity[kind]:
            raise SplitserveError(f"bad length {text!r}: use N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN")
        return cls(kind, *values)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.expovariate(1.0 / self.a)
        return max(1, int(round(value)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind != "exp" else "")


def _turn(vocab: PromptVocab, rng: random.Random, num_tokens: int, max_tokens: int) -> Turn:
    words = vocab.exact(rng, num_tokens)
    return Turn(vocab.text(words), num_tokens, max_tokens)


def synthetic(vocab: PromptVocab, num_requests: int, input_len: LengthDist, output_len: LengthDist,
              seed: int = 0) -> list[Conversation]:
    """Independent prompts with lengths drawn from `input_len`, outputs from `output_len`."""
    rng = random.Random(seed)
    return [Conversation(f"s{i}", [_turn(vocab, rng, input_len.sample(rng), output_len.sample(rng))])
            for i in range(num_requests)]


def shared_prefix(vocab: PromptVocab, num_tenants: int, prefix_len: int, questions_per_tenant: int,
                  question_len: LengthDist, output_len: LengthDist, seed: int = 0) -> list[Conversation]:
    """Multi-tenant traffic: each tenant's prompts are its own `prefix_len`-token prefix (a
    system prompt, a document) followed by one of its questions. Requests of all
    tenants are interleaved in a seeded random order, as they would arrive."""
    if min(num_tenants, prefix_len, questions_per_tenant) < 1:
        raise SplitserveError("shared-prefix needs at least one tenant, one prefix token and one question")
    rng = random.Random(seed)
    out = []
    for t in range(num_tenants):
        prefix = vocab.exact(rng, prefix_len)
        for q in range(questions_per_tenant):
            n = question_len.sample(rng)
            words = vocab.exact(rng, n, prefix=prefix)
            out.append(Conversation(f"t{t}q{q}", [Turn(vocab.text(words), prefix_len + n,
                                                       output_len.sample(rng))], group=f"tenant-{t}"))
    rng.shuffle(out)
    return out


def multi_turn(vocab: PromptVocab, num_sessions: int, num_turns: int, input_len: LengthDist,
               output_len: LengthDist, seed: int = 0) -> list[Conversation]:
    """Chat sessions of `num_turns` user turns each; turn k's prompt holds turns 1..k-1 and
    the answers the server gave to them (assembled by the client at run time)."""
    if num_turns < 1:
        raise SplitserveError("multi-turn needs at least one turn per session")
    rng = random.Random(seed)
    return [Conversation(f"c{i}", [_turn(vocab, rng, input_len.sample(rng), output_len.sample(rng))
                                   for _ in range(num_turns)], group=f"session-{i}")
            for i in range(num_sessions)]


def num_conversations_for(num_requests: int | None, turns_per_conversation: int,
                          default: int = 1000) -> int:
    """How many conversations to build so that `num_requests` requests never run out."""
    if num_requests is None:
        return default
    return max(1, math.ceil(num_requests / max(1, turns_per_conversation)))


@dataclass(slots=True)
class Workload:
    """A built workload: its conversations, a name, its parameters, and notes for reports."""

    name: str
    conversations: list[Conversation]
    params: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    cyclic: bool = True       # may the runner start over when it runs out (a trace may not)

    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)
