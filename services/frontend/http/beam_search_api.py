"""`use_beam_search` on /v1/completions and /v1/chat/completions: which requests may use it, and
its parameters.

vLLM's servers take `n` as the beam width, `max_tokens`, `length_penalty`, `ignore_eos`,
`include_stop_str_in_output` and `temperature` for beam search (`to_beam_search_params`) and
pass over every other sampling field. splitserve refuses a field it would pass over, naming
it, when the request sets it to anything but its neutral value: stop strings and stop tokens
(beams end at EOS or max_tokens only, as in vLLM), top_p/top_k/min_p, penalties, logit_bias,
min_tokens, bad_words, allowed_token_ids, structured outputs, prompt_logprobs, echo with
logprobs (vLLM has no prompt logprobs to echo then), best_of other than n. A streamed
completions request is refused with vLLM's words; a streamed chat request is served as vLLM
serves it: the role chunk of every choice, then each choice's whole reply in one chunk.
The beam search itself is services/frontend/beam_search.py.
"""

from __future__ import annotations

from splitserve.services.frontend.beam_search import BeamSearchParams, beam_width_problem
from splitserve.services.frontend.errors import invalid

# Fields beam search does not use, and the values that ask for nothing (vLLM's defaults).
_NEUTRAL = {"stop": (None, [], ""), "stop_token_ids": (None, []), "top_p": (None, 1.0), "top_k": (None, 0, -1),
            "min_p": (None, 0.0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
            "repetition_penalty": (None, 1.0), "logit_bias": (None, {}), "min_tokens": (0,),
            "bad_words": (None, []), "allowed_token_ids": (None,), "prompt_logprobs": (None,),
            "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
            "structural_tag": (None,), "structured_outputs": (None,)}
STREAMING_REFUSED = "Streaming is not currently supported with beam search"      # vLLM's words (completions)


def beam_search_problems(body) -> list[tuple[str, str]]:
    """(param, message) for each field of a request that cannot go with its beam search; a
    length_penalty without beam search."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            return [("length_penalty", "length_penalty only applies to beam search (use_beam_search=true)")]
        return []
    problems = []
    width = body.n or 1
    for name, neutral in _NEUTRAL.items():
        value = getattr(body, name, None)
        if value not in neutral:
            problems.append((name, f"{name} cannot be used with beam search: beams are ranked by the model's "
                                   f"logprobs alone and end only at EOS or max_tokens (got {value!r})"))
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.get("type") != "text":
        problems.append(("response_format", "response_format cannot be used with beam search: beams are not "
                                            "constrained by a grammar"))
    if getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        problems.append(("tool_choice", "a required or named tool_choice cannot be used with beam search: it "
                                        "constrains the output with a grammar"))
    is_completion = hasattr(body, "best_of")
    if is_completion and body.best_of is not None and body.best_of != width:
        problems.append(("best_of", f"best_of cannot differ from n with beam search: the beam width is n, and the "
                                    f"n best beams are returned (got best_of={body.best_of}, n={width})"))
    if is_completion and body.stream:
        problems.append(("stream", STREAMING_REFUSED))
    if is_completion and body.echo and body.logprobs is not None:
        problems.append(("echo", "echo with logprobs cannot be used with beam search: it has no prompt logprobs"))
    return problems


def beam_search_params(body, max_tokens: int, num_top_logprobs: int, max_logprobs: int) -> BeamSearchParams:
    """vLLM's to_beam_search_params: n is the beam width; `max_tokens` as the frontend resolved it;
    a width the workers' `max_logprobs` cannot serve is a 400 naming `n`."""
    problem = beam_width_problem(body.n or 1, max_logprobs)
    if problem is not None:
        raise invalid(problem, "n")
    return BeamSearchParams(beam_width=body.n or 1, max_tokens=max_tokens, length_penalty=body.length_penalty,
                            ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
                            num_top_logprobs=num_top_logprobs)
