"""The OpenAI-compatible API through the official openai client: models, completions, chat, streaming, usage."""

from __future__ import annotations

import json

import openai
import pytest

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture()
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def plain(server, max_tokens: int = 16) -> str:
    return server.http.post("/v2/models/plain/generate", json={
        "text_input": PROMPT, "sampling_param_max_tokens": max_tokens,
        "sampling_param_exclude_input_from_output": True}).json()["text_output"]


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert {"tensorrt_llm", "eagle_model", "ensemble", "plain", "draft_model"} <= set(ids)
    assert client.models.retrieve("tensorrt_llm").id == "tensorrt_llm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion_greedy_equals_plain(client, server):
    out = client.completions.create(model="tensorrt_llm", prompt=PROMPT, max_tokens=16, temperature=0)
    assert out.object == "text_completion" and out.model == "tensorrt_llm"
    choice = out.choices[0]
    assert choice.text == plain(server) and choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 16 and out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    echoed = client.completions.create(model="tensorrt_llm", prompt=PROMPT, max_tokens=16, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain(server)


def test_completion_token_ids_and_stop(client, server):
    ids = server.repository.models["tensorrt_llm"].engine.encode(PROMPT)
    out = client.completions.create(model="tensorrt_llm", prompt=ids, max_tokens=16, temperature=0)
    assert out.choices[0].text == plain(server)
    full = plain(server)
    stop = full[3:6]
    if stop.strip():
        cut = client.completions.create(model="tensorrt_llm", prompt=PROMPT, max_tokens=16, temperature=0,
                                        stop=[stop])
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_token_id_prompts_echo_their_text_and_out_of_range_ids_are_refused(client, server):
    """Token ids are checked once, by the engine, before their text is decoded for the echo."""
    engine = server.repository.models["tensorrt_llm"].engine
    ids = engine.encode(PROMPT)
    out = client.completions.create(model="tensorrt_llm", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(engine.tokenizer.decode(ids))
    vocab = engine.model.spec.vocab_size
    for bad in ([*ids, vocab], [-1, *ids], [*ids[:2], 10**12]):
        reply = server.http.post("/v1/completions", json={"model": "tensorrt_llm", "prompt": bad, "echo": True,
                                                           "max_tokens": 4})
        assert reply.status_code == 400, bad
        assert f"prompt token ids must be integers in [0, {vocab})" in reply.json()["error"]["message"]


def test_seed_reproducible(client):
    runs = [client.completions.create(model="eagle_model", prompt=PROMPT, max_tokens=12, temperature=0.9,
                                      seed=7).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_chat(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    out = client.chat.completions.create(model="tensorrt_llm", messages=messages, max_completion_tokens=12,
                                         temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and isinstance(out.choices[0].message.content, str)
    assert out.usage.completion_tokens <= 12
    parts = client.chat.completions.create(
        model="tensorrt_llm", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}])
    assert parts.choices[0].message.content == out.choices[0].message.content


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(model="tensorrt_llm", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Say hi"}])
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 12
    assert all(c.usage is None for c in chunks[:-1])
    finals = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finals in (["stop"], ["length"])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    whole = client.chat.completions.create(model="tensorrt_llm", max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "Say hi"}])
    assert text == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_raw_sse(server):
    with server.http.stream("POST", "/v1/completions", json={
            "model": "tensorrt_llm", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    blocks = body.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain(server)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_default_model_when_omitted(server):
    r = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] in {m.name for m in server.repository.ready_models()}
