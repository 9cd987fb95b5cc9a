"""Hostile input over both HTTP APIs: hypothesis-generated requests mixing valid and invalid values for every field
of every generation route (Triton generate / generate_stream / infer, OpenAI completions / chat, streaming or not),
regression tests for known failures, and a poisoned request among normal concurrent ones.

The properties, for every request:
- the status is below 500 and nothing takes longer than 30 s;
- a 4xx carries its protocol's error body: Triton `{"error": "<string>"}`, OpenAI `{"error": {"message": ...}}`;
- a 200 is well formed (its JSON body, or its SSE events ending as the protocol ends them, with no in-band error);
- a request the protocol forbids is refused: a KServe tensor whose shape does not match its data, a temperature or
  top_p that is NaN or infinite;
- greedy outputs are the same after the hostile requests as before them.

Each property test runs all its examples (no shrinking, so the time stays bounded), then fails listing every
failing case at once: route, headers, body, status and response.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

TIMEOUT = httpx.Timeout(30.0, connect=5.0)
EXAMPLES = 400  # per API
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
GOOD_PROMPTS = ("def add(a, b):", "Once upon a time", "The quick brown fox", "for i in range(10):", "hi")
MODELS = ("tensorrt_llm", "eagle_model", "draft_model", "ensemble", "plain")
STYLE = {"tensorrt_llm": "llmapi", "plain": "llmapi", "eagle_model": "vllm", "draft_model": "vllm",
         "ensemble": "ensemble"}
NAN, INF = float("nan"), float("inf")
DEEP = b"[" * 100_000

# Values that json.dumps cannot write: each marker string is replaced, quotes included, by raw JSON text.
BAD_UTF8 = "\x07bad-utf8\x07"
DIGITS = "\x07digits\x07"
OVERFLOW = "\x07overflow\x07"
DEEP_VALUE = "\x07deep\x07"
RAW = {BAD_UTF8: b'"a\xff\xfe\xc0\xaf\xed\xa0\x80b"',  # a stray byte, an overlong '/', an encoded surrogate
       DIGITS: b"9" * 5000,  # beyond Python's int-from-text limit
       OVERFLOW: b"1e99999",  # parses to inf
       DEEP_VALUE: b"[" * 100_000 + b"]" * 100_000}


def to_json(payload) -> bytes:
    """JSON text as a hostile client writes it: NaN / Infinity literals, \\udfff escapes, the RAW values."""
    text = json.dumps(payload, allow_nan=True).encode()
    for marker, raw in RAW.items():
        text = text.replace(json.dumps(marker).encode(), raw)
    return text


@dataclass
class Case:
    api: str  # "triton" | "openai": the error format its 4xx must have
    path: str
    body: bytes
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    must_refuse: str = ""  # why the request must get a 4xx, if it must

    def __str__(self) -> str:
        body = re.sub(rb"(.)\1{63,}", lambda m: b"<%s x %d>" % (m[1], len(m[0])), self.body, flags=re.S)
        body = body if len(body) <= 400 else body[:300] + b"..." + body[-60:]
        headers = {k: v for k, v in self.headers.items() if k != "content-type" or v != "application/json"}
        return f"POST {self.path} {headers or ''} {body!r}"


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def send(client: httpx.Client, case: Case) -> httpx.Response:
    return client.post(case.path, content=case.body, headers=case.headers)


# ---- the properties ---------------------------------------------------------------------------------------------

def violations(client: httpx.Client, case: Case) -> list[str]:
    """What is wrong with the server's answer to `case` (empty: nothing)."""
    start = time.monotonic()
    try:
        r = send(client, case)
    except httpx.HTTPError as exc:
        return [f"{case}\n    -> no response after {time.monotonic() - start:.1f} s: {exc!r}"]
    problem = response_problem(case, r)
    if problem is None:
        return []
    text = r.text if len(r.text) <= 400 else r.text[:400] + "..."
    return [f"{case}\n    -> {r.status_code} {problem}: {text}"]


def response_problem(case: Case, r: httpx.Response) -> str | None:
    if r.status_code >= 500:
        return "server error"
    if r.status_code >= 400:
        return error_format_problem(case.api, r)
    if case.must_refuse:
        return f"accepted although {case.must_refuse}"
    if r.status_code != 200:
        return "unexpected status"
    try:
        well_formed(case, r)
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"malformed 200 ({exc!r})"
    return None


def error_format_problem(api: str, r: httpx.Response) -> str | None:
    try:
        body = r.json()
    except ValueError:
        return "error without a JSON body"
    if api == "triton":
        ok = isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    else:
        error = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]
    return None if ok else f"error body not in the {api} format"


def well_formed(case: Case, r: httpx.Response) -> None:
    """Raise (AssertionError, KeyError, ...) if a 200 is not what its route answers with."""
    event_stream = r.headers.get("content-type", "").startswith("text/event-stream")
    if case.api == "openai":
        return openai_stream_ok(case, r.text) if event_stream else openai_body_ok(case, r.json())
    model = triton_model(case.path)
    if case.path.endswith("/infer"):
        return infer_ok(r, model)
    assert event_stream == case.path.endswith("/generate_stream"), "content type"
    if not event_stream:
        return triton_output_ok(r.json(), model)
    assert r.text.endswith("\n\n"), "the stream's end"
    blocks = r.text.split("\n\n")[:-1]
    assert blocks, "no event"
    for block in blocks:
        assert block.startswith("data: "), block
        triton_output_ok(json.loads(block[len("data: "):]), model)


def triton_model(path: str) -> str:
    return path.split("/")[3]  # /v2/models/<model>/...


def triton_output_ok(body: dict, model: str) -> None:
    assert "error" not in body, "in-band error"
    assert body["model_name"] == model and isinstance(body["model_version"], str), "model"
    assert isinstance(body["text_output"], str), "text_output"


def infer_ok(r: httpx.Response, model: str) -> None:
    if r.headers.get("content-type", "").startswith("application/octet-stream"):
        split = int(r.headers["inference-header-content-length"])
        head, tail = json.loads(r.content[:split]), r.content[split:]
    else:
        head, tail = r.json(), b""
    assert head["model_name"] == model, "model_name"
    outputs = head["outputs"]
    assert isinstance(outputs, list)
    sizes = 0
    for out in outputs:
        assert isinstance(out["name"], str) and isinstance(out["datatype"], str) and isinstance(out["shape"], list)
        if "data" in out:
            assert isinstance(out["data"], list) and len(out["data"]) == math.prod(out["shape"]), "data vs shape"
        else:
            sizes += out["parameters"]["binary_data_size"]
    assert sizes == len(tail), "binary sizes"


def openai_body_ok(case: Case, body: dict) -> None:
    chat = "/chat/" in case.path
    assert body["object"] == ("chat.completion" if chat else "text_completion"), "object"
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices, "choice indices"
    for choice in choices:
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), "choice"
    usage = body["usage"]
    assert all(isinstance(usage[k], int) and usage[k] >= 0 for k in ("prompt_tokens", "completion_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], "usage"


def openai_stream_ok(case: Case, text: str) -> None:
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", "the stream's end"
    chunks = []
    for block in blocks[:-2]:
        assert block.startswith("data: "), block
        chunks.append(json.loads(block[len("data: "):]))
    assert chunks, "no chunk"
    assert all("error" not in c for c in chunks), "in-band error"
    kind = "chat.completion.chunk" if "/chat/" in case.path else "text_completion"
    assert all(c["object"] == kind for c in chunks), "object"
    finals = {}  # one finish reason per choice
    for c in chunks:
        if c["choices"] and c["choices"][0]["finish_reason"]:
            index = c["choices"][0]["index"]
            assert index not in finals, f"choice {index} finished twice"
            finals[index] = c["choices"][0]["finish_reason"]
    assert sorted(finals) == list(range(len(finals))) and finals, f"finish reasons {finals}"
    assert set(finals.values()) <= {"stop", "length"}, f"finish reasons {finals}"


def greedy_outputs(client: httpx.Client) -> list[str]:
    """Greedy texts through each API and a few models: what hostile requests must not change."""
    generate = client.post("/v2/models/tensorrt_llm/generate", json={
        "text_input": PROMPT, "sampling_param_max_tokens": 24, "sampling_param_exclude_input_from_output": True})
    vllm = client.post("/v2/models/eagle_model/generate", json={
        "text_input": PROMPT, "exclude_input_in_output": True, "parameters": {"temperature": 0, "max_tokens": 24}})
    completion = client.post("/v1/completions", json={"model": "draft_model", "prompt": PROMPT, "max_tokens": 24,
                                                      "temperature": 0})
    chat = client.post("/v1/chat/completions", json={"model": "tensorrt_llm", "max_tokens": 24, "temperature": 0,
                                                     "messages": [{"role": "user", "content": PROMPT}]})
    for r in (generate, vllm, completion, chat):
        assert r.status_code == 200, r.text
    return [generate.json()["text_output"], vllm.json()["text_output"], completion.json()["choices"][0]["text"],
            chat.json()["choices"][0]["message"]["content"]]


def run_property(client: httpx.Client, cases) -> None:
    """Send every example of the strategy `cases`; fail listing all the failing ones; greedy outputs unchanged."""
    before = greedy_outputs(client)
    failures, count = [], [0]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def each(case: Case) -> None:
        count[0] += 1
        failures.extend(violations(client, case))

    each()
    after = greedy_outputs(client)
    if after != before:
        failures.append(f"greedy outputs changed after the hostile requests: {before} -> {after}")
    assert count[0] >= EXAMPLES * 0.9, f"only {count[0]} examples ran"
    assert not failures, f"{len(failures)} of {count[0]} hostile requests failed:\n" + "\n".join(failures)


# ---- strategies -------------------------------------------------------------------------------------------------

def pool(*values):
    return st.sampled_from(values)


class Values:
    """The value strategies, built on first use (hypothesis may be missing: only the property tests need it)."""

    def __init__(self):
        self.junk = pool(None, True, False, "", " ", "x", "\x00", "\udfff", "a\udfffb", BAD_UTF8, DIGITS, OVERFLOW,
                         DEEP_VALUE, [], {}, [[]], [None], {"a": 1}, NAN, INF, -INF, -1, 0, 1, 2**64, -(2**63) - 1,
                         10**40, 1e308, -1e308, 5e-324, "NaN", "-Infinity", "1e999", "0x10", [1, 2], [[1]],
                         "9" * 400)
        self.floats = st.one_of(pool(0, 0.0, -0.0, 0.5, 1, 1.0, 2, 1e-300, 5e-324, 1e-46, 1e-45, 1e308, 100, -0.5,
                                     -1e-300, NAN, INF, -INF, "0.5", "nan", [0.5], [[NAN]]),
                                # subnormals: the model turns on flush-to-zero (transformer.py), hypothesis refuses
                                st.floats(allow_subnormal=False), self.junk)
        self.ints = st.one_of(st.integers(1, 8), pool(0, -1, -4, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64,
                                                      10**30, -(2**63), 4.0, 1.5, 1e300, "4", " 4 ", "four", NAN,
                                                      INF, [4], [[4]], [4, 4]), st.integers(), self.junk)
        self.bools = st.one_of(st.booleans(), pool("true", "false", "True", 1, 0, 2, -1, "maybe", [True], [[False]],
                                                   NAN), self.junk)
        self.texts = st.one_of(
            pool(*GOOD_PROMPTS, " ", "\n", "\t\r\n", "日本語のテキスト", "emoji 😀🙃", "<s></s><pad>", "x" * 5000,
                 "hello " * 2000, "\x00", "", "a\udfffb", "\udfff", "\ud800\udc00", "x\ud83d", BAD_UTF8, "{" * 1000),
            st.text(st.characters(categories=["L", "N", "P", "Z", "Cc", "Cs", "So"]), max_size=40))
        self.stops = st.one_of(pool("\n", " ", "def", ["\n", "x"], "", [""], [1], [["\n"]], None, {}, "\udfff",
                                    ["a" * 10000], [""] * 1000, [" "] * 1000, BAD_UTF8),
                               self.texts, st.lists(self.texts, max_size=4), self.junk)
        self.token_ids = st.lists(st.one_of(pool(-1, -(2**63), 0, 1, 2, 383, 384, 385, 2**31, 2**63, 2**64, 10**30,
                                                 1.0, 2.5, True, "5", None), st.integers(3, 383)), max_size=8)
        self.prompts = st.one_of(self.texts, self.token_ids, self.token_ids.map(lambda ids: [ids]),
                                 st.lists(self.texts, min_size=1, max_size=3), self.junk)
        roles = pool("user", "system", "assistant", "tool", "developer", "", "robot", "\udfff", 5, None, ["user"])
        contents = st.one_of(self.texts, pool(None, [{"type": "text", "text": "hi"}],
                                              [{"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}],
                                              [{"type": "image_url", "image_url": {"url": "http://x"}}],
                                              [{"type": "text", "text": 5}], [{"type": "text"}], [5], [], {}, 5,
                                              NAN), self.junk)
        message = st.one_of(st.fixed_dictionaries({"role": roles, "content": contents}),
                            st.fixed_dictionaries({"role": roles}), st.fixed_dictionaries({"content": contents}),
                            self.junk)
        many = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(2000)]
        self.messages = st.one_of(st.lists(message, max_size=4), pool(many, [{"role": "user", "content": ""}] * 3000),
                                  self.junk)
        self.models = st.one_of(pool(*MODELS), pool("nope", "", "preprocessing", "\udfff", "tensorrt_llm\x00",
                                                    ["tensorrt_llm"], 5, "x" * 1000), self.junk)


_values: Values | None = None


def values() -> Values:
    global _values
    if _values is None:
        _values = Values()
    return _values


def openai_fields(v: Values) -> dict:
    return {
        "model": v.models, "prompt": v.prompts, "messages": v.messages, "max_tokens": v.ints,
        "max_completion_tokens": v.ints, "temperature": v.floats, "top_p": v.floats, "top_k": v.ints,
        "seed": v.ints, "stop": v.stops, "n": v.ints, "best_of": v.ints, "logprobs": st.one_of(v.ints, v.bools),
        "top_logprobs": v.ints, "echo": v.bools, "stream": v.bools, "ignore_eos": v.bools, "min_tokens": v.ints,
        "stream_options": pool({}, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True},
                               {"include_usage": "yes"}, {"include_usage": NAN}, [], "x", None),
        "presence_penalty": v.floats, "frequency_penalty": v.floats, "repetition_penalty": v.floats,
        "stop_token_ids": st.one_of(v.token_ids, v.junk), "suffix": v.texts, "user": v.texts,
        "logit_bias": pool({}, {"5": 100}, {"-1": NAN}, [], "x", None),
        "response_format": pool({"type": "text"}, {"type": "json_object"}, {}, "text", [], None, {"type": NAN},
                                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                                {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}},
                                {"type": "json_schema", "json_schema": {"schema": {"minimum": NAN}}},
                                {"type": "json_schema"}, {"type": "json_schema", "json_schema": "x"}),
        "guided_regex": pool("(yes|no)", "a(b", "", 5, None, "\udfff", "a{99999999}"),
        "guided_choice": pool(["a", "b"], [], [5], ["\udfff"], "x", None),
        "guided_json": pool({"type": "object"}, "{bad", '{"type": "integer"}', 5, None, {"type": NAN}),
        "guided_grammar": pool('start: "a" | "b"', "start: foo", "root ::= x", "", None),
        "structured_outputs": pool({"regex": "a"}, {"choice": []}, {"json": "{"}, {"x": 1}, {"regex": "a", "json": {}},
                                   [], "x", None),
        "tools": pool([], [{"type": "function"}], "x", None, [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]),
        "tool_choice": pool("none", "auto", "required", {"type": "function"}, 5, None),
        "chat_template_kwargs": pool({}, {"x": 1}, [], "x", None),
        "unknown_field": v.junk, "": v.junk, "\udfff": v.junk,
    }


# temperature / top_p / top_k / seed together, in OpenAI's names
SAMPLING_COMBOS = ({"temperature": 0.5, "top_p": 1e-300}, {"temperature": 0.5, "top_p": 5e-324},
                   {"temperature": 0.5, "top_p": 1e-46}, {"temperature": 1e-300, "top_p": 1e-300},
                   {"temperature": 1e308, "top_k": 1}, {"temperature": 2.0, "top_p": 0.999999, "top_k": 1},
                   {"temperature": 1.0, "top_k": 10**30}, {"temperature": NAN, "top_p": 0.5}, {"temperature": INF},
                   {"temperature": 0.5, "top_p": NAN}, {"temperature": 0.5, "seed": 2**64},
                   {"temperature": 0.5, "seed": -1}, {"temperature": 0.5, "seed": 2**63},
                   {"temperature": 5e-324, "top_k": -1})
LLMAPI_NAMES = {"temperature": "sampling_param_temperature", "top_p": "sampling_param_top_p",
                "top_k": "sampling_param_top_k", "seed": "sampling_param_seed"}
ENSEMBLE_NAMES = {"temperature": "temperature", "top_p": "runtime_top_p", "top_k": "runtime_top_k",
                  "seed": "random_seed"}


def edit(draw, body: dict, fields: dict, combos) -> None:
    """One change to a request body: a field set to a drawn value, a field removed, or a sampling combination."""
    kind = draw(pool("set", "set", "set", "drop", "combo"))
    if kind == "set":
        key = draw(pool(*fields))
        body[key] = draw(fields[key])
    elif kind == "drop" and body:
        del body[draw(pool(*body))]
    else:
        body.update(draw(pool(*combos)))


def transport(draw, api: str, path: str, payload, must_refuse: str = "", headers: dict | None = None) -> Case:
    """The request as bytes on the wire, sometimes broken: cut, padded, not an object, nested 100,000 deep, with
    a BOM, an odd Content-Type or a Content-Encoding."""
    body = to_json(payload)
    how = draw(pool(*["as is"] * 10, "cut", "trailing", "bom", "not an object", "empty", "deep", "whitespace"))
    if how == "cut":
        body = body[:draw(st.integers(0, max(len(body) - 1, 0)))]
    elif how == "trailing":
        body += draw(pool(b"}", b"xyz", b"\x00", b",", b" {}", b"\xff"))
    elif how == "bom":
        body = b"\xef\xbb\xbf" + body
    elif how == "not an object":
        body = draw(pool(b"[]", b"[{}]", b'"text"', b"1", b"-0", b"null", b"true", b"NaN", b"Infinity", b"1e999",
                         b"[" + body + b"]"))
    elif how == "empty":
        body = draw(pool(b"", b"   ", b"\n"))
    elif how == "deep":
        body = draw(pool(DEEP, DEEP + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000))
    elif how == "whitespace":
        body = b" " * 1_000_000 + body
    headers = dict(headers or {})
    content_type = draw(pool(*["application/json"] * 6, "text/plain", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", "application/json; charset=latin-1", None))
    if content_type:
        headers["content-type"] = content_type
    encoding = draw(pool(*[None] * 10, "identity", "gzip", "GZIP", "deflate", "br", "x" * 200))
    if encoding:
        headers["content-encoding"] = encoding
        if encoding == "gzip" and draw(st.booleans()):
            body = gzip.compress(body)
    return Case(api, path, body, headers, must_refuse)


def non_finite_sampling(body) -> str:
    """Why a request with a NaN / infinite temperature or top_p must be refused ('' if it has none)."""
    if not isinstance(body, dict):
        return ""
    scopes = [body] + [body[k] for k in ("parameters",) if isinstance(body.get(k), dict)]
    for scope in scopes:
        for key, value in scope.items():
            if ("temperature" in key or "top_p" in key) and isinstance(value, float) and not math.isfinite(value):
                return f"{key} is {value}"
    return ""


def openai_case(draw) -> Case:
    v = values()
    chat = draw(st.booleans())
    body = {"model": draw(pool(*MODELS)), "max_tokens": draw(st.integers(1, 8)), "temperature": draw(pool(0, 0.7))}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(pool(*GOOD_PROMPTS))}]
    else:
        body["prompt"] = draw(pool(*GOOD_PROMPTS))
    if draw(st.booleans()):
        body["stream"] = True
    if draw(st.booleans()):  # a hostile prompt, besides the edits
        if chat:
            body["messages"] = draw(v.messages)
        else:
            body["prompt"] = draw(st.one_of(v.token_ids, v.token_ids.map(lambda ids: [ids]), v.prompts))
    fields = openai_fields(v)
    for _ in range(draw(st.integers(1, 3))):
        edit(draw, body, fields, SAMPLING_COMBOS)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return transport(draw, "openai", path, body, non_finite_sampling(body))


def triton_fields(v: Values) -> dict:
    fields = {"text_input": st.one_of(v.texts, v.texts.map(lambda t: [t]), v.texts.map(lambda t: [[t]]),
                                      st.lists(v.texts, min_size=2, max_size=3), v.junk),
              "parameters": st.one_of(st.fixed_dictionaries({}, optional={"max_tokens": v.ints,
                                                                          "temperature": v.floats,
                                                                          "top_p": v.floats, "stream": v.bools}),
                                      v.junk),
              "sampling_parameters": st.one_of(
                  st.fixed_dictionaries({}, optional={"max_tokens": v.ints, "temperature": v.floats,
                                                      "top_p": v.floats, "seed": v.ints}).map(
                      lambda d: json.dumps(d, allow_nan=True)),
                  pool("{", "[]", "null", "NaN", '{"temperature": NaN}', '{"top_p": 1e-300, "temperature": 0.5}'),
                  v.junk),
              "id": st.one_of(pool("req-1", "", 5, "\udfff", "x" * 10000), v.junk),
              "stop": st.one_of(v.bools, v.stops), "stop_token_ids": st.one_of(v.token_ids, v.junk),
              "end_id": v.ints, "pad_id": v.ints, "bad_words": v.stops, "logprobs": v.ints,
              "guided_decoding_guide_type": st.one_of(pool("json", "json_schema", "regex", "ebnf_grammar", "xml",
                                                           ["regex"]), v.junk),
              "guided_decoding_guide": st.one_of(pool('{"type": "object"}', "{bad", "a(b", "(yes|no)",
                                                      'root ::= "a"', ""), v.junk),
              "unknown_input": v.junk, "": v.junk, "\udfff": v.junk}
    for names, strategy in [
            (("sampling_param_max_tokens", "max_tokens", "request_output_len", "min_tokens", "min_length",
              "sampling_param_top_k", "top_k", "runtime_top_k", "sampling_param_seed", "seed", "random_seed", "n",
              "beam_width", "best_of"), v.ints),
            (("sampling_param_temperature", "temperature", "sampling_param_top_p", "top_p", "runtime_top_p",
              "frequency_penalty", "repetition_penalty", "min_p"), v.floats),
            (("sampling_param_stop", "stop_words"), v.stops),
            (("sampling_param_exclude_input_from_output", "exclude_input_in_output", "streaming", "stream",
              "ignore_eos", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
              "sampling_param_return_perf_metrics", "return_perf_metrics", "return_log_probs",
              "return_logprobs", "return_cumulative_logprob",
              "skip_special_tokens"), v.bools)]:
        fields.update(dict.fromkeys(names, strategy))
    return fields


def generate_body(draw, model: str, stream_route: bool) -> dict:
    prompt, max_tokens, style = draw(pool(*GOOD_PROMPTS)), draw(st.integers(1, 8)), STYLE[model.split("/")[0]]
    if style == "vllm":
        body = {"text_input": prompt, "parameters": {"max_tokens": max_tokens, "temperature": 0}}
    elif style == "ensemble":
        body = {"text_input": prompt, "max_tokens": max_tokens}
    else:
        body = {"text_input": prompt, "sampling_param_max_tokens": max_tokens}
    if stream_route and model != "plain" and draw(st.booleans()):
        body["streaming" if style == "llmapi" and draw(st.booleans()) else "stream"] = True
    names = {"vllm": {}, "ensemble": ENSEMBLE_NAMES, "llmapi": LLMAPI_NAMES}[style]
    combos = [{names.get(k, k): value for k, value in combo.items()} for combo in SAMPLING_COMBOS]
    fields = triton_fields(values())
    if draw(st.booleans()):  # a hostile prompt, besides the edits
        body["text_input"] = draw(fields["text_input"])
    for _ in range(draw(st.integers(1, 3))):
        scope = body["parameters"] if isinstance(body.get("parameters"), dict) and draw(st.booleans()) else body
        edit(draw, scope, fields, combos)
    return body


DTYPES = ("BYTES", "INT32", "INT64", "UINT8", "FP32", "FP64", "BOOL", "FP16", "BF16", "STRING", "", "int32", None, 5)
SHAPES = ([1], [1, 1], [4, 4], [0], [], [-1], [2], [2**63], [1.5], ["1"], [True], None, "1", [[1]], [1, -1])
INFER_NAMES = ("text_input", "max_tokens", "sampling_param_max_tokens", "temperature", "top_p", "top_k", "seed",
               "stream", "streaming", "stop", "end_id", "exclude_input_in_output", "bogus", "", 5, None)


def shape_mismatch(inputs) -> str:
    """Why a KServe request's JSON tensors must be refused: a shape that is not its data's ('' if none is)."""
    for tensor in inputs if isinstance(inputs, list) else []:
        if not isinstance(tensor, dict) or "data" not in tensor or (tensor.get("parameters") or {}) != {}:
            continue
        shape = tensor.get("shape")
        dims_ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        if not dims_ok or math.prod(shape) != count_elements(tensor["data"]):
            return f"input {tensor.get('name')!r} has shape {shape!r} for {count_elements(tensor['data'])} elements"
    return ""


def count_elements(data) -> int:
    return sum(count_elements(d) for d in data) if isinstance(data, list) else 1


def infer_body(draw, model: str) -> tuple[dict, bytes, str | None]:
    """(JSON header, binary tail, Inference-Header-Content-Length) of a hostile KServe infer request."""
    v = values()
    batched = model.startswith("ensemble")

    def tensor(name, datatype, value, shape=None):
        return {"name": name, "datatype": datatype, "shape": shape or ([1, 1] if batched else [1]),
                "data": [[value]] if batched else [value]}

    prompt = draw(st.one_of(pool(*GOOD_PROMPTS), v.texts))
    inputs = [tensor("text_input", "BYTES", prompt),
              tensor("max_tokens", "INT32", draw(st.integers(1, 8)))]
    body: dict = {"inputs": inputs}
    by_name = {"text_input": v.texts, "temperature": v.floats, "top_p": v.floats, "stream": v.bools,
               "streaming": v.bools, "exclude_input_in_output": v.bools}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(pool("tensor", "tensor", "add", "combo", "drop", "top"))
        if kind == "tensor" and inputs:
            target = draw(pool(*inputs))
            key = draw(pool("name", "datatype", "shape", "shape", "data", "data", "parameters", "delete"))
            if key == "delete" and target:
                del target[draw(pool(*target))]
            elif key != "delete":
                target[key] = draw({"name": pool(*INFER_NAMES), "datatype": pool(*DTYPES), "shape": pool(*SHAPES),
                                    "data": st.one_of(v.prompts, v.ints.map(lambda x: [x]), v.junk),
                                    "parameters": pool({}, {"binary_data_size": 4}, {"binary_data_size": -1}, 5,
                                                       [], {"binary_data_size": NAN})}[key])
        elif kind == "add":
            name = draw(pool(*INFER_NAMES))
            inputs.append(tensor(name, draw(pool(*DTYPES)), draw(by_name.get(name, v.ints)),
                                 draw(st.one_of(st.none(), pool(*SHAPES)))))
        elif kind == "combo":
            inputs += [tensor("temperature", "FP32", 0.5), tensor("top_p", "FP32", draw(pool(1e-300, 5e-324, 1e-46)))]
        elif kind == "drop" and inputs:
            inputs.remove(draw(pool(*inputs)))
        else:
            key = draw(pool("outputs", "parameters", "id", "inputs"))
            body[key] = draw(st.one_of(
                pool([{"name": "text_output"}], [{"name": "text_output", "parameters": {"binary_data": True}}],
                     [{"name": "bogus"}], [{"name": "text_output", "parameters": 5}], ["text_output"], [5],
                     {"binary_data_output": True}, {"binary_data_output": "x"}, {"stream": True}),
                v.junk))
    if draw(pool(*[False] * 5, True)):  # the prompt as binary data
        raw = draw(pool("héllo".encode(), b"\xff\xfe", b"", b"ok" * 1000))
        blob = len(raw).to_bytes(4, "little") + raw
        size = draw(pool(len(blob), len(blob), len(blob) + 10, 3, -1))
        inputs[:1] = [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                       "parameters": {"binary_data_size": size}}]
        head_length = len(to_json(body))
        header = draw(pool(str(head_length), str(head_length), "-1", "abc", str(10**20), "0", ""))
        return body, blob, header
    return body, b"", None


def triton_case(draw) -> Case:
    model = draw(pool(*MODELS, "tensorrt_llm/versions/1"))
    endpoint = draw(pool("generate", "generate_stream", "infer"))
    headers = None
    if endpoint == "infer":
        body, tail, header = infer_body(draw, model)
        must_refuse = shape_mismatch(body.get("inputs")) or non_finite_infer(body.get("inputs"))
        if header is not None:
            headers = {"inference-header-content-length": header}
    else:
        body, tail = generate_body(draw, model, endpoint == "generate_stream"), b""
        must_refuse = non_finite_sampling(body)
    if draw(pool(*[False] * 9, True)):
        model = draw(pool("nope", "tensorrt_llm/versions/9", "preprocessing", "x" * 300, "ensemble/versions/0"))
    case = transport(draw, "triton", f"/v2/models/{model}/{endpoint}", body, must_refuse, headers)
    case.body += tail
    return case


def non_finite_infer(inputs) -> str:
    """A temperature / top_p tensor holding NaN or an infinity must be refused."""
    for tensor in inputs if isinstance(inputs, list) else []:
        if isinstance(tensor, dict) and isinstance(tensor.get("data"), list):
            reason = non_finite_sampling({str(tensor.get("name")): _first(tensor["data"])})
            if reason:
                return reason
    return ""


def _first(data):
    while isinstance(data, list) and len(data) == 1:
        data = data[0]
    return data


def test_hostile_triton_requests(client):
    run_property(client, st.composite(triton_case)())


def test_hostile_openai_requests(client):
    run_property(client, st.composite(openai_case)())


# ---- regressions: known failures, one request each ----------------------------------------------------------------

def check(client: httpx.Client, case: Case) -> httpx.Response:
    """Send `case` and assert the properties; return the response."""
    r = send(client, case)
    problem = response_problem(case, r)
    assert problem is None, f"{case} -> {r.status_code} {problem}: {r.text[:500]}"
    return r


def openai_body(chat: bool, prompt: str = "def add(a, b):", **fields) -> dict:
    body = {"model": "tensorrt_llm", "max_tokens": 8, **fields}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def route_case(route: str, prompt: str = "def add(a, b):", raw: bytes | None = None, **sampling) -> Case:
    """A request with `prompt` and the sampling fields (OpenAI names) on one of the generation routes."""
    if route.startswith("/v1"):
        body = openai_body(route.endswith("chat/completions"), prompt, **sampling)
        return Case("openai", route, raw if raw is not None else to_json(body))
    model, endpoint = route.split(":")
    style = STYLE[model]
    if endpoint == "infer":
        inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]},
                  {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [8]}]
        inputs += [{"name": k, "datatype": "FP32", "shape": [1], "data": [value]} for k, value in sampling.items()]
        body = {"inputs": inputs}
    elif style == "vllm":
        body = {"text_input": prompt, "exclude_input_in_output": True, "parameters": {"max_tokens": 8, **sampling}}
    else:
        names = LLMAPI_NAMES if style == "llmapi" else ENSEMBLE_NAMES
        body = {"text_input": prompt, "max_tokens": 8, **{names[k]: value for k, value in sampling.items()}}
        body["exclude_input_in_output"] = True
    return Case("triton", f"/v2/models/{model}/{endpoint}", raw if raw is not None else to_json(body))


def output_text(case: Case, r: httpx.Response) -> str:
    if case.api == "openai":
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "/chat/" in case.path else choice["text"]
    if case.path.endswith("/infer"):
        return r.json()["outputs"][0]["data"][0]
    return r.json()["text_output"]


V1 = ["/v1/completions", "/v1/chat/completions"]
ALL_ROUTES = ["tensorrt_llm:generate", "tensorrt_llm:generate_stream", "tensorrt_llm:infer", "eagle_model:generate",
              "ensemble:generate", *V1]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("route", V1)
def test_non_finite_temperature_is_refused_on_v1(client, route, literal):
    raw = to_json(openai_body(route.endswith("chat/completions"), temperature=0.5)).replace(b"0.5", literal.encode())
    case = route_case(route, raw=raw)
    case.must_refuse = f"temperature is {literal}"
    r = check(client, case)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
@pytest.mark.parametrize("route", ["tensorrt_llm:generate", "eagle_model:generate", "ensemble:generate",
                                   "tensorrt_llm:infer", *V1])
def test_top_p_keeping_nothing_samples_the_top_token(client, route, top_p):
    """A top-p so small that no token reaches it (in float32 too) keeps the most likely token: the greedy output.
    A 400 is acceptable too; a 500 or any other output is not."""
    greedy = route_case(route, temperature=0.0)
    expected = output_text(greedy, check(client, greedy))
    case = route_case(route, temperature=0.5, top_p=top_p)
    r = check(client, case)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert output_text(case, r) == expected


@pytest.mark.parametrize("route", ALL_ROUTES)
def test_lone_surrogate_in_prompt(client, route):
    case = route_case(route, prompt="a\udfffb")
    assert b"\\udfff" in case.body
    check(client, case)


@pytest.mark.parametrize("body", [DEEP, DEEP + b"]" * 100_000, b'{"text_input": ' + DEEP],
                         ids=["unclosed", "closed", "in-a-field"])
@pytest.mark.parametrize("route", ALL_ROUTES)
def test_deeply_nested_json_is_refused(client, route, body):
    case = route_case(route, raw=body)
    case.must_refuse = "the body is not a request"
    assert check(client, case).status_code == 400


@pytest.mark.parametrize("prompt", [[5, -1, 7], [-1], [[5, -1, 7]], [5, -(2**63)], [5, 384], [5, 2**63], [5, 2**64]],
                         ids=["negative", "only-negative", "nested", "int64-min", "vocab-size", "int64-overflow",
                              "uint64-overflow"])
@pytest.mark.parametrize("stream", [False, True])
def test_token_id_outside_the_vocabulary_is_refused(client, prompt, stream):
    case = Case("openai", "/v1/completions", to_json({"model": "tensorrt_llm", "prompt": prompt, "max_tokens": 4,
                                                     "stream": stream}), must_refuse="a token id is out of range")
    assert check(client, case).status_code == 400


@pytest.mark.parametrize("tensor", [
    {"name": "text_input", "datatype": "BYTES", "shape": [4, 4], "data": ["hi"]},
    {"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["hi"]},
    {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi", "there"]},
    {"name": "max_tokens", "datatype": "INT32", "shape": [4, 4], "data": [4]},
], ids=["text 4x4 of 1", "text 2 of 1", "text 1 of 2", "max_tokens 4x4 of 1"])
def test_infer_shape_not_matching_data_is_refused(client, tensor):
    inputs = {"text_input": {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
              "max_tokens": {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [4]}}
    inputs[tensor["name"]] = tensor
    case = Case("triton", "/v2/models/tensorrt_llm/infer", to_json({"inputs": list(inputs.values())}))
    case.must_refuse = shape_mismatch(list(inputs.values()))
    assert case.must_refuse and check(client, case).status_code == 400


def test_infer_input_given_twice_is_refused(client):
    """Which of two same-named inputs counts would be a guess: a temperature of inf followed by 0 was served."""
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
              {"name": "temperature", "datatype": "FP64", "shape": [1], "data": [float("inf")]},
              {"name": "temperature", "datatype": "FP64", "shape": [1], "data": [0]}]
    response = check(client, Case("triton", "/v2/models/tensorrt_llm/infer", to_json({"inputs": inputs})))
    assert response.status_code == 400 and "input 'temperature' is given more than once" in response.json()["error"]


@pytest.mark.parametrize("body", [
    {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"], "parameters": 5}]},
    {"inputs": [{"name": "text_output", "parameters": 5}]},
    {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
     "outputs": [{"name": "text_output", "parameters": [1]}]},
], ids=["input parameters 5", "unknown input parameters 5", "output parameters [1]"])
def test_infer_tensor_parameters_that_are_not_objects_are_refused(client, body):
    response = check(client, Case("triton", "/v2/models/draft_model/infer", to_json(body)))
    assert response.status_code == 400 and "must be a JSON object" in response.json()["error"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("content", ["hi", "", "tell me more about that " * 5])
def test_thousands_of_chat_messages_get_a_quick_answer(client, content, stream):
    messages = [{"role": ("user", "assistant")[i % 2], "content": content} for i in range(1999)]
    messages.append({"role": "user", "content": "and now?"})
    case = Case("openai", "/v1/chat/completions", to_json({"model": "tensorrt_llm", "messages": messages,
                                                          "max_tokens": 4, "stream": stream}))
    start = time.monotonic()
    r = check(client, case)
    assert time.monotonic() - start < 5.0
    if r.status_code != 200:
        assert len(r.json()["error"]["message"]) > 10


# ---- a poisoned request among normal ones -------------------------------------------------------------------------

NORMAL = [  # (path, body, SSE data -> text): greedy, 256 tokens each, streamed so they are running when poison comes
    ("/v2/models/tensorrt_llm/generate_stream",
     {"text_input": "def add(a, b):", "stream": True, "exclude_input_in_output": True,
      "sampling_param_max_tokens": 256, "ignore_eos": True}, lambda d: d["text_output"]),
    ("/v1/completions", {"model": "tensorrt_llm", "prompt": "Once upon a time", "max_tokens": 256,
                         "temperature": 0, "ignore_eos": True, "stream": True},
     lambda d: d["choices"][0]["text"]),
    ("/v1/chat/completions", {"model": "tensorrt_llm", "max_tokens": 256, "temperature": 0, "ignore_eos": True,
                              "stream": True, "messages": [{"role": "user", "content": "The quick brown fox"}]},
     lambda d: d["choices"][0]["delta"].get("content") or "" if d["choices"] else ""),
]
POISON = {
    "v1 NaN temperature": Case("openai", "/v1/completions", b'{"model": "tensorrt_llm", "prompt": "hi", '
                                                           b'"max_tokens": 8, "temperature": NaN}'),
    "v1 top_p 1e-300": Case("openai", "/v1/completions", to_json({
        "model": "tensorrt_llm", "prompt": "hi", "max_tokens": 8, "temperature": 0.5, "top_p": 1e-300})),
    "triton top_p 1e-300": Case("triton", "/v2/models/tensorrt_llm/generate", to_json({
        "text_input": "hi", "sampling_param_max_tokens": 8, "sampling_param_temperature": 0.5,
        "sampling_param_top_p": 1e-300})),
}


def stream_text(url: str, path: str, body: dict, text_of, started: threading.Event | None = None
                ) -> tuple[str, float]:
    """A streamed request's whole text and when it ended; `started` is set once its first event has arrived."""
    texts = []
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, f"normal request {path}: {r.status_code} {r.read()!r}"
        buffer = ""
        for piece in r.iter_text():
            buffer += piece
            *events, buffer = buffer.split("\n\n")
            for event in events:
                data = event.removeprefix("data: ")
                if data != "[DONE]":
                    payload = json.loads(data)
                    assert "error" not in payload, f"normal request {path} failed: {payload}"
                    texts.append(text_of(payload))
                if started is not None:
                    started.set()
    return "".join(texts), time.monotonic()


@pytest.mark.parametrize("poison", list(POISON))
def test_poisoned_request_does_not_fail_its_batch(server, client, poison):
    alone = [stream_text(server.url, path, body, text_of)[0] for path, body, text_of in NORMAL]
    started = [threading.Event() for _ in NORMAL]
    with ThreadPoolExecutor(len(NORMAL)) as pool_:
        futures = [pool_.submit(stream_text, server.url, path, body, text_of, event)
                   for (path, body, text_of), event in zip(NORMAL, started)]
        assert all(event.wait(30) for event in started), "the normal requests did not start"
        r = send(client, POISON[poison])
        poison_done = time.monotonic()
        results = [outcome(f) for f in futures]
    wrong = [f"{path}: {text[:300]!r}, alone {ref[:80]!r}..."
             for (path, _, _), (text, _), ref in zip(NORMAL, results, alone) if text != ref]
    assert not wrong, f"normal requests beside {POISON[poison]}:\n" + "\n".join(wrong)
    problem = response_problem(POISON[poison], r)
    assert problem is None, f"{POISON[poison]} -> {r.status_code} {problem}: {r.text[:300]}"
    assert poison_done < min(end for _, end in results), "the poisoned request did not overlap the normal ones"


def outcome(future) -> tuple[str, float]:
    """A normal request's (text, end time), or its failure as the text."""
    try:
        return future.result()
    except AssertionError as exc:
        return f"FAILED: {str(exc).splitlines()[0]}", 0.0
