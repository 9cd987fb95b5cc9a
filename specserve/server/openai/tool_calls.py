"""Tool calls in a model's output text: the formats specserve reads, whole (a response) or as it streams (deltas).

Two formats are specserve's own, written by the grammar that enforces a tool choice (server/openai/tools.py):

* a named function: the output is the call's arguments, a JSON object (vLLM's form for a named `tool_choice`);
* `required`: a JSON array of `{"name": <tool>, "parameters": <arguments>}` objects (vLLM's form), written as
  json.dumps writes it (the grammar allows no other whitespace).

Three are the models' own, for `tool_choice: "auto"`, as their chat templates teach them:

* `hermes` (Hermes, Qwen 2.5 / 3 and others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
  after any text;
* `llama3_json` (Llama 3.1-3.3): the answer is `{"name": ..., "parameters": {...}}`, several joined by `;`,
  optionally after `<|python_tag|>`;
* `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (the marker is a special
  token, absent where the detokenizer drops those: the array alone is read too).

A model's output that does not parse in its format is its answer, as text (vLLM does the same). Arguments are
sent as the exact text the model wrote, so a streamed call reassembles to the response's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

DECODER = json.JSONDecoder()
REQUIRED_CALL = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "parameters": ')


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that opens at text[start]; None while it is unclosed."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


# ------------------------------------------------------------------------------------------------------------------
# the grammar-enforced formats: calls grow as the text does


def named_calls(name: str, text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments so far, complete) of a named function's output."""
    return [(name, text, json_value_end(text, 0) is not None)] if text else [(name, "", False)]


def required_calls(text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments so far, complete) of each call a `required` array holds so far."""
    calls, pos = [], 1  # past "["
    while True:
        match = REQUIRED_CALL.match(text, pos)
        if match is None:
            return calls
        start = match.end()
        end = json_value_end(text, start)
        calls.append((match.group(1), text[start: len(text) if end is None else end], end is not None))
        if end is None:
            return calls
        pos = end + len("}, ")


# ------------------------------------------------------------------------------------------------------------------
# the models' own formats (tool_choice "auto")


@dataclass(frozen=True)
class ModelFormat:
    """A model's tool-call format: the markers that open its calls, whether they must open the answer, and the
    key its calls put their arguments under."""

    name: str
    markers: tuple[str, ...]
    at_start: bool
    arguments_keys: tuple[str, ...] = ("arguments",)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]] | None:
        """(content before the calls or None, calls), or None when the text holds no calls in this format."""
        start = self.calls_start(text)
        if start is None:
            return None
        objects = self._call_objects(text[start:])
        if not objects:
            return None
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            arguments = next((obj[k] for k in self.arguments_keys if k in obj), {})
            calls.append(ToolCall(obj["name"], arguments if isinstance(arguments, str)
                                  else json.dumps(arguments, ensure_ascii=False)))
        content = text[:start]
        return (content if content.strip() else None), calls

    def calls_start(self, text: str) -> int | None:
        if self.at_start:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.markers) else None
        found = [text.find(m) for m in self.markers if m in text]
        return min(found) if found else None

    def _call_objects(self, text: str) -> list | None:
        try:
            if self.name == "hermes":
                blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL)
                return [json.loads(block) for block in blocks]
            text = text.strip().removeprefix("<|python_tag|>").removeprefix("[TOOL_CALLS]").strip()
            if self.name == "mistral":
                value = json.loads(text)
                return value if isinstance(value, list) else [value]
            objects, pos = [], 0  # llama3_json: objects joined by ";"
            while pos < len(text):
                obj, pos = DECODER.raw_decode(text, pos)
                objects.append(obj)
                pos = len(text) - len(text[pos:].lstrip().removeprefix(";").lstrip())
            return objects
        except ValueError:
            return None


MODEL_FORMATS = {
    "hermes": ModelFormat("hermes", ("<tool_call>",), at_start=False),
    "llama3_json": ModelFormat("llama3_json", ("<|python_tag|>", "{"), at_start=True,
                               arguments_keys=("parameters", "arguments")),
    "mistral": ModelFormat("mistral", ("[TOOL_CALLS]", "["), at_start=True),
}


def template_format(template: str | None) -> ModelFormat | None:
    """The tool-call format a chat template teaches its model, found by its markers; None if it teaches none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return MODEL_FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return MODEL_FORMATS["mistral"]
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return MODEL_FORMATS["llama3_json"]
    return None


# ------------------------------------------------------------------------------------------------------------------
# whole responses and streams


class ToolOutput:
    """How one choice's output becomes an assistant message: a `named` function's arguments, a model's own `form`
    (auto), or else a `required` array. `message` reads a whole output; `feed` / `close` turn a stream's text into
    chat deltas."""

    def __init__(self, named: str | None = None, form: ModelFormat | None = None):
        self.named, self.form = named, form
        self.text = ""
        self.ids: list[str] = []  # each streamed call's id
        self.sent: list[int] = []  # how much of each call's arguments went out
        self.mode = "undecided" if form is not None else "calls"
        self.sent_text = 0

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(the assistant message, the finish reason: "tool_calls" for calls that ended naturally)."""
        if self.form is not None:
            content, calls = self.form.parse(text) or (text, [])
        else:
            content, calls = None, [ToolCall(name, arguments) for name, arguments, _ in self._grown(text)]
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]},
                _finish(finish_reason, True))

    def _grown(self, text: str) -> list[tuple[str, str, bool]]:
        return named_calls(self.named, text) if self.named is not None else required_calls(text)

    def feed(self, text: str) -> list[dict]:
        """The chat deltas for the next piece of streamed text."""
        self.text += text
        if self.form is None:
            return self._call_deltas()
        if self.mode == "undecided":
            self._decide()
        if self.mode == "text":
            return self._text_delta(len(self.text))
        if self.form.at_start:  # a call may open the answer: hold it until it is known
            return []
        return self._text_delta(self._text_end())

    def close(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas (a model's calls go out whole, once its answer is complete) and the finish reason."""
        if self.form is None:
            return self._call_deltas(), _finish(finish_reason, bool(self.ids))
        parsed = self.form.parse(self.text) if self.mode == "calls" else None
        if parsed is None:
            return self._text_delta(len(self.text)), finish_reason
        content, calls = parsed
        deltas = self._text_delta(self.form.calls_start(self.text)) if content else []
        deltas += [{"tool_calls": [{"index": i, **call.openai()}]} for i, call in enumerate(calls)]
        return deltas, _finish(finish_reason, True)

    def _decide(self) -> None:
        """Auto: calls, text, or not known yet (the text so far could still open a call)."""
        if self.form.at_start:
            head = self.text.lstrip()
            if not head or any(m.startswith(head) for m in self.form.markers if len(head) < len(m)):
                return
            self.mode = "calls" if head.startswith(self.form.markers) else "text"
        elif self.form.calls_start(self.text) is not None:
            self.mode = "calls"

    def _text_end(self) -> int:
        """How much of the text may go out as content: all before a call's marker, or before a tail that could be
        the start of one."""
        start = self.form.calls_start(self.text)
        if start is not None:
            return start
        held = max((k for m in self.form.markers for k in range(1, len(m)) if self.text.endswith(m[:k])),
                   default=0)
        return len(self.text) - held

    def _text_delta(self, end: int) -> list[dict]:
        if end <= self.sent_text:
            return []
        piece, self.sent_text = self.text[self.sent_text: end], end
        return [{"content": piece}]

    def _call_deltas(self) -> list[dict]:
        """Grammar-enforced calls: a call's id and name when its name is known, then its arguments as they grow."""
        deltas = []
        for index, (name, arguments, _) in enumerate(self._grown(self.text)):
            if index == len(self.ids):
                call = ToolCall(name, "")
                self.ids.append(call.id)
                self.sent.append(0)
                deltas.append({"tool_calls": [{"index": index, **call.openai()}]})
            if len(arguments) > self.sent[index]:
                piece, self.sent[index] = arguments[self.sent[index]:], len(arguments)
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas


def _finish(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason
