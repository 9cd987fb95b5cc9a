"""OpenAI tool calling: the request's tools and choice, the grammar a forced choice decodes under (lossless with
n-gram, suffix and EAGLE-3 speculation), the output formats read whole and streamed, and 400s for bad tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from specserve.engine.engine import Engine
from specserve.server.errors import InputError
from specserve.server.openai.messages import template_messages
from specserve.server.openai.tool_calls import MODEL_FORMATS, ToolOutput, required_calls, template_format
from specserve.server.openai.tools import MAX_TOOLS, parse_tools
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.suffix import SuffixMethod
from tests.speculative.test_eagle import engine_for, save_random

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def tools_for(choice, parallel: bool = True, template: str | None = None, parser: str | None = None):
    return parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}, template, parser)


def assert_valid_calls(message: dict) -> None:
    assert message["tool_calls"], message
    for call in message["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


# ---- the grammar: lossless under speculation ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(loaded, tmp_path_factory):
    target = loaded("llama")
    head = save_random(target, "eagle3", tmp_path_factory.mktemp("eagle3_head"))
    return {"plain": Engine(target), "ngram": Engine(target, NGramMethod(1, 3), 4),
            "suffix": Engine(target, SuffixMethod(), 8), "eagle3": engine_for(target, "eagle3", head)}


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), (NAMED, True)])
def test_forced_tool_calls_validate_and_equal_plain_decoding(engines, choice, parallel):
    tools = tools_for(choice, parallel)
    params = SamplingParams(max_tokens=120, guide=tools.guide())
    prompt = "Call a function: the weather in Paris."
    expected = engines["plain"].generate(prompt, params)
    message, finish_reason = tools.output().message(expected.text, expected.finish_reason)
    if expected.finish_reason == "length":  # a random model may call on and on: the complete calls validate
        assert parallel and finish_reason == "length"
        message["tool_calls"] = message["tool_calls"][:-1]
    else:
        assert finish_reason == "tool_calls"
    assert_valid_calls(message)
    if choice == NAMED:
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    if not parallel:
        assert len(message["tool_calls"]) == 1
    for name in ("ngram", "suffix", "eagle3"):
        assert engines[name].generate(prompt, params).token_ids == expected.token_ids, name


# ---- output formats ----------------------------------------------------------------------------------------------


def stream(output: ToolOutput, text: str, step: int = 3) -> tuple[dict, str]:
    """The deltas of `text` fed `step` characters at a time, reassembled as a client does."""
    content, calls = "", {}
    deltas = [d for i in range(0, len(text), step) for d in output.feed(text[i: i + step])]
    more, finish_reason = output.close("stop")
    for delta in deltas + more:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
    return {"content": content or None, "calls": [(c["name"], c["arguments"]) for c in calls.values()]}, finish_reason


def whole(output: ToolOutput, text: str) -> tuple[dict, str]:
    message, finish_reason = output.message(text, "stop")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return {"content": message["content"], "calls": calls}, finish_reason


REQUIRED_TEXT = '[{"name": "get_weather", "parameters": {"city": "Pa}ris\\"", "days": 3}}, ' \
                '{"name": "get_time", "parameters": {"zone": "UTC"}}]'
CASES = [
    (dict(named="get_weather"), '{"city": "Paris", "days": 3}',
     {"content": None, "calls": [("get_weather", '{"city": "Paris", "days": 3}')]}),
    (dict(), REQUIRED_TEXT, {"content": None, "calls": [("get_weather", '{"city": "Pa}ris\\"", "days": 3}'),
                                                        ("get_time", '{"zone": "UTC"}')]}),
    (dict(form=MODEL_FORMATS["hermes"]),
     'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>',
     {"content": "Let me look.\n", "calls": [("get_time", '{"zone": "CET"}'),
                                             ("get_weather", '{"city": "Oslo", "days": 1}')]}),
    (dict(form=MODEL_FORMATS["hermes"]), "No call here, just <tool text.",
     {"content": "No call here, just <tool text.", "calls": []}),
    (dict(form=MODEL_FORMATS["llama3_json"]),
     ' {"name": "get_time", "parameters": {"zone": "PST"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
     {"content": None, "calls": [("get_time", '{"zone": "PST"}'), ("get_time", '{"zone": "UTC"}')]}),
    (dict(form=MODEL_FORMATS["llama3_json"]), "{braces} in a plain answer",
     {"content": "{braces} in a plain answer", "calls": []}),
    (dict(form=MODEL_FORMATS["mistral"]), '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     {"content": None, "calls": [("get_time", '{"zone": "UTC"}')]}),
]


@pytest.mark.parametrize("kind, text, expected", CASES)
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_outputs_read_whole_and_streamed_alike(kind, text, expected, step):
    reason = "tool_calls" if expected["calls"] else "stop"
    assert whole(ToolOutput(**kind), text) == (expected, reason)
    streamed, finish_reason = stream(ToolOutput(**kind), text, step)
    assert finish_reason == reason
    assert streamed["calls"] == expected["calls"]
    assert (streamed["content"] or "").strip() == (expected["content"] or "").strip()


def test_grammar_calls_stream_their_name_before_their_arguments():
    output = ToolOutput()
    first = output.feed('[{"name": "get_time", "parameters": {"zo')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert first[0]["tool_calls"][0]["id"].startswith("call_")
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"zo'}
    assert required_calls('[{"name": "get_time", "parameters": {"zo') == [("get_time", '{"zo', False)]


def test_a_cut_off_call_keeps_its_finish_reason():
    message, finish_reason = ToolOutput(named="get_weather").message('{"city": "Pa', "length")
    assert finish_reason == "length" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'


def test_template_formats_are_found_by_their_markers():
    assert template_format("{{ '<tool_call>' }}").name == "hermes"
    assert template_format("[TOOL_CALLS] {{ x }}").name == "mistral"
    assert template_format("<|python_tag|>{{ x }}").name == "llama3_json"
    assert template_format("{{ messages }}") is None and template_format(None) is None


# ---- requests ----------------------------------------------------------------------------------------------------


def test_choices_and_their_guides():
    assert tools_for("none").guide() is None and tools_for("none").output() is None
    assert tools_for(NAMED).guide().spec == WEATHER
    required = tools_for("required", parallel=False).guide().spec
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert tools_for("auto", template="<tool_call>").form.name == "hermes"
    assert tools_for("auto", parser="mistral").form.name == "mistral"
    assert parse_tools({"messages": []}, None, None) is None


@pytest.mark.parametrize("body, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]}, "strin"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "object"),
    ({"tools": [{"type": "retrieval"}]}, "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": TOOLS + TOOLS[:1]}, "twice"),
    ({"tools": TOOLS * (MAX_TOOLS // 2 + 1)}, str(MAX_TOOLS)),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "sometimes"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "needs 'tools'"),
])
def test_bad_tools_name_the_field(body, words):
    with pytest.raises(InputError, match=words.replace("-", r"\-")) as info:
        parse_tools(body, "{{ messages }}", None)
    assert info.value.param in ("tools", "tool_choice", "parallel_tool_calls")


def test_tool_messages_need_a_matching_call():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    rendered = template_messages(history)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    with pytest.raises(InputError, match="tool_call_id"):
        template_messages([MESSAGES[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}])
    bad = {**call, "function": {"name": "get_time", "arguments": "{not json"}}
    with pytest.raises(InputError, match="arguments"):
        template_messages([MESSAGES[0], {"role": "assistant", "tool_calls": [bad]}])


# ---- through the server, with the openai client ------------------------------------------------------------------


@pytest.fixture()
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def chat(client, model: str, **kwargs):
    return client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                          temperature=0, **kwargs)


def reassembled(chunks) -> tuple[list[tuple[str, str]], str]:
    calls, finish_reason = {}, None
    for c in chunks:
        for choice in c.choices:
            finish_reason = choice.finish_reason or finish_reason
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or "" if call.function else ""
                entry[1] += call.function.arguments or "" if call.function else ""
    return [tuple(v) for v in calls.values()], finish_reason


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_openai_client_tool_calls_with_speculation_equal_plain(client, choice):
    speculative = chat(client, "tensorrt_llm", tool_choice=choice)  # n-gram speculation
    plain = chat(client, "plain", tool_choice=choice)
    got = speculative.choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content is None
    assert_valid_calls(got.message.model_dump())
    assert [c.function for c in got.message.tool_calls] == [c.function for c in plain.choices[0].message.tool_calls]
    streamed, finish_reason = reassembled(chat(client, "tensorrt_llm", tool_choice=choice, stream=True))
    assert finish_reason == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in got.message.tool_calls]


def test_openai_client_history_with_tool_results(client):
    first = chat(client, "tensorrt_llm", tool_choice=NAMED).choices[0].message
    history = MESSAGES + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model="tensorrt_llm", messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS * 500}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "y"}]}, "messages"),
])
def test_bad_tool_requests_are_400s(server, body, param):
    response = server.http.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES,
                                                              "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
