"""splitserve's SamplingParams built as vLLM's own `SamplingParams` in the engine environment
(services/engine_vllm/engine.py's `to_vllm_params`): the values arrive, bad words stay token
sequences, outputs are deltas without text, and vLLM's own validation becomes InvalidRequestError."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

CHECK = textwrap.dedent("""
    import json
    from splitserve.errors import InvalidRequestError
    from splitserve.services.engine_vllm.engine import to_vllm_params
    from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput
    p = to_vllm_params(SamplingParams(
        max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=11, stop=["x"], stop_token_ids=[2],
        logprobs=3, presence_penalty=0.1, repetition_penalty=1.1, logit_bias={7: -1.5}, min_tokens=2,
        structured=StructuredOutput("choice", '["yes", "no"]'), allowed_token_ids=[7, 8], bad_words=[[1, 2]],
        prompt_logprobs=1))
    out = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "seed": p.seed,
           "stop": p.stop, "stop_token_ids": p.stop_token_ids, "logprobs": p.logprobs, "min_tokens": p.min_tokens,
           "logit_bias": {str(k): v for k, v in p.logit_bias.items()}, "allowed": p.allowed_token_ids,
           "bad_words": p.bad_words_token_ids, "choice": p.structured_outputs.choice,
           "kind": p.output_kind.name, "detokenize": p.detokenize, "prompt_logprobs": p.prompt_logprobs}
    try:
        to_vllm_params(SamplingParams(temperature=3.0))
    except InvalidRequestError as exc:
        out["refused"] = str(exc)
    print("RESULT " + json.dumps(out))
""")


def test_to_vllm_params_in_the_engine_environment(vllm_python):
    done = subprocess.run([vllm_python, "-c", CHECK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got.pop("refused").startswith("temperature must be in [0, 2], got 3.0")
    assert got == {"max_tokens": 9, "temperature": 0.7, "top_k": 5, "seed": 11, "stop": [], "stop_token_ids": [2],
                   "logprobs": 3, "min_tokens": 2, "logit_bias": {"7": -1.5}, "allowed": [7, 8],
                   "bad_words": [[1, 2]], "choice": ["yes", "no"], "kind": "DELTA", "detokenize": False,
                   "prompt_logprobs": 1}
