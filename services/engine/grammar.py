"""Structured outputs: the token masks that keep a request's output inside a grammar.

xgrammar (chosen by bench/grammar_backends.py: its masks are 4-13x faster than
llguidance's here) compiles a request's StructuredOutput against the model's
vocabulary: a JSON schema, any JSON object, a regex, a list of choices, an EBNF
grammar, or a structural tag. Compiled grammars are cached by xgrammar's compiler
(by kind and text), and each sequence gets its own GrammarMatcher. Each step the
sampler fills one bitmask row per constrained sequence and applies them all to the
logits in one call (`apply_masks`); the engine then advances each matcher by the
token it accepted.

JSON is compact (no free whitespace between tokens), as vLLM's
`disable-any-whitespace` gives it: a small model left free to emit whitespace can
fill max_tokens with it and never close the object. Compact JSON never holds a raw
control character (U+0000-U+001F; inside strings they are escaped), so JSON rows
also mask every token that decodes to one: xgrammar 0.2.9 lets them into strings
with a minLength/maxLength (its issue #800), which would be invalid JSON.

Importing xgrammar takes about 2 s (it pulls in transformers), so nothing imports it
until a structured request arrives; the worker compiles on a thread before it queues
the request (`compile`), so neither cost lands on the engine's step loop.

A request continued after a migration, and a decode worker given the prefill
worker's first token, replay the output so far through a new matcher: the grammar
state is a function of the tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from splitserve.errors import InvalidRequestError
from splitserve.services.worker_protocol.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from splitserve.services.text.tokenizer import Tokenizer

CACHE_LIMIT_BYTES = 256 * 2**20       # compiled grammars kept (xgrammar evicts the least recently used)
MAX_COMPILED = 256                    # specs whose compiled grammar the engine thread finds by lookup
_EBNF_SPECIAL = re.compile(r'(["\\])')
_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


JSON_KINDS = frozenset({"json_schema", "json_object"})


@dataclass(slots=True)
class GrammarState:
    """One sequence's grammar: its matcher, and for JSON the mask of control-character tokens."""

    matcher: Any
    json_mask: torch.Tensor | None = None     # int32 bitmask row: 0 bits for tokens JSON never holds


class StructuredOutputs:
    """One engine's grammar compiler (thread-safe) and the matchers of its sequences."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._json_mask: torch.Tensor | None = None
        # Compiled grammars by spec: the engine thread's second `compile` of a request (the
        # worker's thread compiled it first) is a lookup, not a new Grammar from the schema text.
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec` (cached); raises InvalidRequestError for a bad spec."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = self._get_compiler().compile_grammar(grammar_of(spec))
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def state(self, spec: StructuredOutput, prior_output: list[int]) -> GrammarState:
        """A sequence's grammar at the state after `prior_output` (tokens generated before a
        migration); raises InvalidRequestError when the spec is bad or they do not match it."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(spec))
        for position, token in enumerate(prior_output):
            if not matcher.accept_token(token):
                raise InvalidRequestError(f"the output so far does not match the {_DESCRIBED[spec.kind]} "
                                          f"(token {token} at output position {position})")
        return GrammarState(matcher, self._json_mask if spec.kind in JSON_KINDS else None)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids or None)
                self._json_mask = _control_character_mask(info)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler


def _control_character_mask(info) -> torch.Tensor:
    """A bitmask row (xgrammar's layout: bit t%32 of word t//32) with 0 for every token whose
    text holds a C0 control character, special tokens (EOS) excepted."""
    import numpy as np

    special = set(info.special_token_ids) | set(info.stop_token_ids)
    allowed = np.ones(-(-info.vocab_size // 32) * 32, dtype=np.uint64)
    for token_id, text in enumerate(info.decoded_vocab):
        if token_id not in special and any(byte < 0x20 for byte in text):
            allowed[token_id] = 0
    words = (allowed.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def apply_masks(logits: torch.Tensor, raw: torch.Tensor, grammars: list[GrammarState | None]) -> None:
    """Mask, in place in `logits` ([N, vocab], the controlled copy of `raw`), every token the
    row's grammar (None: unconstrained) does not allow next. A row whose other controls left no
    token the grammar allows (min_tokens holding back the only end a grammar has) gets the
    grammar's mask over its raw logits: the grammar wins."""
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None]
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
        if grammars[i].json_mask is not None:
            bitmask[i] &= grammars[i].json_mask
    indices = rows if len(rows) < len(grammars) else None
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
    index = torch.tensor(rows, dtype=torch.long)
    dead = index[~(logits.index_select(0, index) > float("-inf")).any(dim=1)].tolist()
    if dead:
        logits[dead] = raw[dead]
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=dead)


def grammar_of(spec: StructuredOutput):
    """The xgrammar Grammar of `spec`, vocabulary-free (the frontend checks requests with it);
    raises InvalidRequestError for a bad spec."""
    import xgrammar as xgr

    kind, text = spec.kind, spec.spec
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(_json(text, kind)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        if kind == "structural_tag":
            return _structural_tag_grammar(_json(text, kind))
    except InvalidRequestError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:     # xgrammar's parse errors are these
        raise InvalidRequestError(f"invalid {_DESCRIBED[kind]}: {_message(exc)}") from exc
    raise InvalidRequestError(f"unknown structured output kind {kind!r}")


def choice_grammar(choices: Any) -> str:
    """An EBNF grammar whose only sentences are the choices (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings")
    escaped = (_EBNF_SPECIAL.sub(r"\\\1", c).replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
               for c in choices)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)


def _structural_tag_grammar(tag: Any):
    """vLLM's two forms: the legacy {"structures": [{begin, schema, end}], "triggers": [...]}
    and xgrammar's own structural tag ({"type": "structural_tag", "format": ...})."""
    import xgrammar as xgr

    if not isinstance(tag, dict):
        raise InvalidRequestError("a structural tag must be a JSON object")
    if "structures" in tag:
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"])
                     for s in tag["structures"]]
            triggers = list(tag["triggers"])
        except (KeyError, TypeError) as exc:
            raise InvalidRequestError(f"invalid structural tag: each structure needs begin, schema and end, "
                                      f"and the tag needs triggers ({exc})") from exc
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def _json(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"invalid {_DESCRIBED[kind]}: not JSON ({exc})") from exc


def _message(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location ("[12:00:00] /project/cpp/x.cc:94: ")."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _SOURCE_LOCATION.sub("", line)[:500]


_DESCRIBED = {"json_schema": "JSON schema", "json_object": "JSON object format", "regex": "regex",
              "choice": "choice list", "grammar": "EBNF grammar", "structural_tag": "structural tag"}
