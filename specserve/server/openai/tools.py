"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` -> what the chat
template is given, the grammar that enforces a choice, and how the output is read (server/openai/tool_calls.py).

* `tool_choice: "none"`: the template still sees the tools (as vLLM and OpenAI do); the answer is text.
* `"required"` and a named function (`{"type": "function", "function": {"name": ...}}`) are enforced by a grammar
  over the functions' `parameters` schemas, so they stay lossless with every speculation method, as structured
  outputs do: a named function's output is its arguments object; `required` writes a JSON array of
  `{"name", "parameters"}` objects, exactly one when `parallel_tool_calls` is false.
* `"auto"` (the default when tools are given): the model decides, and its answer is read in its own tool-call
  format, the one its chat template teaches (`tool_calls.template_format`) or the one `--tool-call-parser` names.
  A model without one gets a 400 that says so: nothing could tell its calls from its text.

Bad input is a 400 naming the field: a tool that is not a function, a name OpenAI would refuse, a `parameters`
that is not an object schema or does not compile, more than MAX_TOOLS tools, a `tool_choice` naming no tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import llguidance

from specserve.server.errors import InputError
from specserve.server.openai.tool_calls import MODEL_FORMATS, ModelFormat, ToolOutput, template_format
from specserve.speculative.grammar import Guide, GuideError

MAX_TOOLS = 128  # OpenAI's own limit; each tool adds a branch to a `required` grammar
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict

    def template_entry(self) -> dict:
        """The tool as chat templates take it (the request's own form)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: str  # none | auto | required | function
    named: str | None  # the function a named choice calls
    parallel: bool
    form: ModelFormat | None  # auto: the model's own tool-call format

    def template_tools(self) -> list[dict]:
        return [f.template_entry() for f in self.functions]

    def guide(self) -> Guide | None:
        """The grammar a forced choice decodes under (None for none and auto)."""
        if self.named is not None:
            return Guide("json_schema", self._function(self.named).parameters)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return Guide("json_schema", array if self.parallel else {**array, "maxItems": 1})

    def output(self) -> ToolOutput | None:
        """How each choice's text becomes a message (None: plain text)."""
        if self.choice == "none":
            return None
        return ToolOutput(named=self.named, form=self.form)

    def _function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)


def parse_tools(body: dict, template: str | None, parser: str | None) -> ToolRequest | None:
    """The request's tools and choice (None without tools); `template` is the chat template in use, `parser` the
    server's --tool-call-parser."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InputError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InputError("'tools' must be a list of tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InputError(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS} are allowed", param="tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InputError(f"tools: the function name {duplicate!r} is given twice", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InputError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    kind, named = _choice(choice, names)
    form = None
    if kind == "auto":
        form = MODEL_FORMATS[parser] if parser else template_format(template)
        if form is None:
            raise InputError("tool_choice 'auto' needs the model's tool-call format, and this model's chat template "
                             "declares none: use tool_choice 'required' or a named function (enforced by a "
                             "grammar), or start the server with --tool-call-parser", param="tool_choice")
    return ToolRequest(functions, kind, named, parallel, form)


def _function(tool, index: int) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InputError(f"{where} must be an object of type 'function'", param="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InputError(f"{where}.function must be an object", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InputError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                         param="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InputError(f"{where}.function.description must be a string", param="tools")
    parameters = function.get("parameters")
    parameters = EMPTY_PARAMETERS if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InputError(f"{where}.function.parameters must be a JSON Schema of type 'object'", param="tools")
    _check_schema(parameters, f"{where}.function.parameters")
    return Function(name, description, parameters)


def _check_schema(schema: dict, where: str) -> None:
    try:
        error = llguidance.LLMatcher.validate_grammar(Guide("json_schema", schema).grammar_text())
    except GuideError as exc:
        error = str(exc)
    if error:
        raise InputError(f"{where} is not a valid JSON Schema: {error}", param="tools")


def _choice(choice, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InputError(f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {choice!r}",
                             param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InputError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise InputError(f"tool_choice names the function {name!r}, which is not in 'tools'", param="tool_choice")
    return "function", name
