"""/v1/responses, /tokenize, /detokenize and /v1/models against a real `splitserve serve --aggregated`.

The official `openai` client drives the Responses API (whole, `create(stream=True)`
and the `responses.stream()` helper that folds the events into a Response); httpx
drives /tokenize and /detokenize, which the client has no method for. Greedy
output through /v1/responses is /v1/chat/completions' for the same messages,
token counts agree with the generation endpoints' usage, and /tokenize then
/detokenize gives the text back.
"""

from __future__ import annotations

import httpx
import openai
import pytest

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
ITEMS = [{"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}]


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


def _chat_greedy(client, model_name, max_tokens: int):
    return client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=max_tokens, temperature=0)


def test_models_carry_max_model_len(server, client, model_name):
    [card] = client.models.list().data
    assert card.id == model_name and card.max_model_len > 0
    assert (card.root, card.parent) == (model_name, None)          # vLLM's ModelCard
    tokenized = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"}).json()
    assert tokenized["max_model_len"] == card.max_model_len


def test_responses_greedy_equals_chat(client, model_name):
    chat = _chat_greedy(client, model_name, 12)
    resp = client.responses.create(model=model_name, instructions="Be brief.", input=ITEMS,
                                   max_output_tokens=12, temperature=0)
    assert resp.object == "response" and resp.output_text == chat.choices[0].message.content
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    plain = client.responses.create(model=model_name, input="Name three colours.", max_output_tokens=8,
                                    temperature=0)
    alone = client.chat.completions.create(model=model_name, messages=[CHAT[1]], max_tokens=8, temperature=0)
    assert plain.output_text == alone.choices[0].message.content


def test_responses_stream_events(client, model_name):
    whole = client.responses.create(model=model_name, instructions="Be brief.", input=ITEMS,
                                    max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=model_name, instructions="Be brief.", input=ITEMS,
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.id == events[-1].response.id


def test_responses_stream_helper(client, model_name):
    whole = client.responses.create(model=model_name, input="Say something.", max_output_tokens=10, temperature=0)
    with client.responses.stream(model=model_name, input="Say something.", max_output_tokens=10,
                                 temperature=0) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"store": True}, "store"),
])
def test_responses_refusals(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input="hi", max_output_tokens=4, **fields)
    assert info.value.body["param"] == param


def test_tokenize_counts_what_generation_prompts(server, client, model_name):
    text = "The quick brown fox"
    out = httpx.post(f"{server.base_url}/tokenize", json={"model": model_name, "prompt": text,
                                                          "return_token_strs": True}).json()
    completion = client.completions.create(model=model_name, prompt=text, max_tokens=1, temperature=0)
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) == completion.usage.prompt_tokens
    chat = httpx.post(f"{server.base_url}/tokenize", json={"model": model_name, "messages": CHAT}).json()
    assert chat["count"] == _chat_greedy(client, model_name, 1).usage.prompt_tokens


def test_tokenize_then_detokenize_round_trips(server):
    for text in ("The quick brown fox", "naïve café 日本語"):
        ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenization_refusals(server):
    wrong = httpx.post(f"{server.base_url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    outside = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**7]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
