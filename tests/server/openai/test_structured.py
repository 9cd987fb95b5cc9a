"""Structured outputs over the OpenAI routes: response_format and vLLM's structured_outputs / guided_* through the
official client, the same constrained output with speculation (n-gram) as without, and 400s for bad guides."""

from __future__ import annotations

import json

import openai
import pytest

from tests.engine.test_structured import SCHEMA, matches_schema

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture()
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def complete(client, model: str, **body) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=80, temperature=0, extra_body=body)


def test_completion_json_schema_with_speculation_equals_plain(client):
    speculative = complete(client, "tensorrt_llm", response_format=RESPONSE_FORMAT)  # n-gram
    plain = complete(client, "plain", response_format=RESPONSE_FORMAT)
    assert speculative.choices[0].text == plain.choices[0].text
    assert speculative.choices[0].finish_reason == "stop"
    assert matches_schema(json.loads(speculative.choices[0].text))


def test_chat_response_format(client):
    messages = [{"role": "user", "content": "Describe a thing as JSON."}]
    out = client.chat.completions.create(model="tensorrt_llm", messages=messages, max_tokens=80, temperature=0,
                                         response_format=RESPONSE_FORMAT)
    assert matches_schema(json.loads(out.choices[0].message.content))
    anything = client.chat.completions.create(model="draft_model", messages=messages, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # max_tokens cut the object short: reported as "length", as OpenAI does
        assert anything.choices[0].message.content.startswith("{")


def test_chat_stream_with_a_guide(client):
    messages = [{"role": "user", "content": "Pick one."}]
    stream = client.chat.completions.create(model="tensorrt_llm", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, extra_body={"guided_choice": ["red", "green", "blue"]})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("red", "green", "blue")


def test_vllm_extras(client):
    regex = complete(client, "eagle_model", structured_outputs={"regex": r"(yes|no), [a-f]{2,6}\."})
    assert regex.choices[0].text.split(", ")[0] in ("yes", "no") and regex.choices[0].text.endswith(".")
    assert complete(client, "tensorrt_llm", guided_json=json.dumps(SCHEMA)).choices[0].text == \
        complete(client, "plain", guided_json=SCHEMA).choices[0].text
    assert complete(client, "tensorrt_llm", guided_grammar='start: "a" | "b" "c"').choices[0].text in ("a", "bc")
    sampled = [complete(client, "tensorrt_llm", guided_choice=["cat", "dog"], temperature=1.0, seed=seed, n=2)
               for seed in range(2)]
    assert all(c.text in ("cat", "dog") for out in sampled for c in out.choices)


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}}, "schema"),
    ({"response_format": {"type": "yaml"}}, "yaml"),
    ({"guided_regex": "a(b"}, "regex"),
    ({"guided_grammar": "start: foo"}, "grammar"),
    ({"guided_choice": []}, "choice"),
    ({"guided_json": "{not json"}, "JSON"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-output guide"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
])
def test_bad_guides_are_400(client, server, body, words):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, "tensorrt_llm", **body)
    assert words in info.value.body["message"]
    reply = server.http.post("/v1/chat/completions", json={
        "model": "tensorrt_llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]
