"""vLLM's /tokenize and /detokenize, and the sampling parameters its benchmark client and OpenAI's clients send."""

from __future__ import annotations

import pytest

from tests.serving.helpers import MODEL, chat_body, completion_body

PROMPT = "Dynamic batching refills a finished slot at the next step."


def test_tokenize_counts_what_a_completion_is_charged_and_detokenize_inverts_it(client):
    tokenized = client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["token_strs"] is None
    completion = client.post("/v1/completions", json=completion_body(PROMPT, max_tokens=1))
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]
    stats = client.get("/stats").json()["replicas"][0]
    assert body["max_model_len"] == stats["max_model_len"]

    text = client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert text.status_code == 200, text.text
    assert text.json() == {"prompt": PROMPT}


def test_tokenize_renders_chat_messages_with_the_template(client):
    messages = chat_body("What is in-flight batching?")["messages"]
    tokenized = client.post("/tokenize", json={"model": MODEL, "messages": messages, "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert len(body["token_strs"]) == body["count"]
    chat = client.post("/v1/chat/completions", json=chat_body("What is in-flight batching?", max_tokens=1))
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]
    plain = client.post("/tokenize", json={"prompt": "What is in-flight batching?"}).json()  # model is optional
    assert plain["count"] < body["count"]  # the template adds the role markers


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": MODEL}, 400, None),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
    ("/tokenize", {"model": MODEL, "prompt": "a", "surprise": 1}, 400, "surprise"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "tool", "content": [{}]}]}, 400, "messages"),  # was a 503
    ("/tokenize", {"model": "other-model", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": MODEL, "tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenize_requests_get_4xx_with_a_message(client, path, body, status, param):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert param in (error["param"] or "")


def test_penalties_and_logit_bias_work_over_http(client):
    """vLLM's client sends repetition_penalty 1.0 on every request; other values, OpenAI's penalties and
    logit_bias are served too: a +100 bias on token 97 makes every token that one."""
    neutral = client.post("/v1/completions", json=completion_body(repetition_penalty=1.0, logprobs=None))
    assert neutral.status_code == 200, neutral.text
    penalised = client.post("/v1/completions", json=completion_body(repetition_penalty=1.3, presence_penalty=0.5,
                                                                    frequency_penalty=-0.5, logprobs=None))
    assert penalised.status_code == 200, penalised.text
    forced = client.post("/v1/completions", json=completion_body(logit_bias={"97": 100}, max_tokens=6,
                                                                 temperature=1.0, logprobs=None, ignore_eos=True))
    assert forced.status_code == 200, forced.text
    piece = client.post("/detokenize", json={"model": MODEL, "tokens": [97]}).json()["prompt"]
    assert forced.json()["choices"][0]["text"] == piece * 6
