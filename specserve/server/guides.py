"""Structured-output request fields -> the engine's `Guide`, as each API spells them; what both front ends share.

* OpenAI: `response_format` `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` (`{"type": "text"}`: no guide).
* vLLM's extras: `structured_outputs: {json | regex | choice | grammar | json_object}` and the older top-level
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (and, in a Triton vLLM request's
  `sampling_parameters`, `structured_outputs` or the older `guided_decoding` object).
* TensorRT-LLM (Triton generate): `guided_decoding_guide_type` (`json`, `json_schema`, `regex`, `ebnf_grammar`) and
  `guided_decoding_guide`.

A request names at most one guide; the grammar itself is checked against the model's vocabulary when the request
is submitted (`Engine.check_request`), so a bad schema, regex or grammar is a 400 before any work.
"""

from __future__ import annotations

import json

from specserve.server.errors import InputError
from specserve.speculative.grammar import Guide, GuideError

# vLLM's StructuredOutputsParams keys that name a guide, and the Guide kind each makes
VLLM_GUIDE_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
# its options that change nothing here: specserve's JSON never has free whitespace and never falls back
VLLM_NEUTRAL_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                        "backend"}
OPENAI_EXTRAS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
TRTLLM_GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "regex": "regex",
                      "ebnf_grammar": "grammar"}


def openai_guide(body: dict) -> Guide | None:
    """The guide an OpenAI completions / chat body asks for, or None; InputError naming the field."""
    found: list[tuple[str, Guide]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    for key in ("structured_outputs", "guided_decoding"):
        if body.get(key) is not None:
            guide = vllm_guide(body[key], key)
            if guide is not None:
                found.append((key, guide))
    for key, vllm_key in OPENAI_EXTRAS.items():
        if body.get(key) is not None:
            found.append((key, _vllm_value(vllm_key, body[key], key)))
    if body.get("guided_whitespace_pattern") is not None:
        raise InputError("'guided_whitespace_pattern' is not supported by specserve", param="guided_whitespace_pattern")
    return _one(found)


def _response_format(value) -> Guide | None:
    if value in (None, {}):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InputError("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InputError("response_format.json_schema must be an object with 'name' and 'schema'",
                             param="response_format")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise InputError("response_format.json_schema.strict must be a boolean", param="response_format")
        schema = spec.get("schema")
        if schema is None:  # OpenAI's schema is optional: any JSON object then
            return Guide("json_object")
        if not isinstance(schema, dict):
            raise InputError("response_format.json_schema.schema must be a JSON Schema object",
                             param="response_format")
        return Guide("json_schema", schema)
    raise InputError(f"response_format type {kind!r} is not supported (text, json_object, json_schema are)",
                     param="response_format")


def vllm_guide(value, field: str) -> Guide | None:
    """vLLM's `structured_outputs` (or `guided_decoding`) object -> Guide; None when it names no guide."""
    if not isinstance(value, dict):
        raise InputError(f"'{field}' must be an object", param=field)
    named = [key for key in VLLM_GUIDE_KEYS if value.get(key) not in (None, False)]
    unknown = sorted(set(value) - set(VLLM_GUIDE_KEYS) - VLLM_NEUTRAL_OPTIONS)
    if unknown:
        raise InputError(f"{field}.{unknown[0]} is not supported by specserve", param=field)
    if len(named) > 1:
        raise InputError(f"'{field}' names {' and '.join(named)}: give exactly one guide", param=field)
    return _vllm_value(named[0], value[named[0]], field) if named else None


def _vllm_value(key: str, value, field: str) -> Guide:
    """One of vLLM's guide values: json (a schema as an object or a JSON string), regex, choice, grammar."""
    if key == "json_object":
        return Guide("json_object")
    if key == "json" and isinstance(value, str):
        value = _json_text(value, field)
    guide = Guide(VLLM_GUIDE_KEYS[key], value)
    _check(guide, field)
    return guide


def trtllm_guide(guide_type, guide) -> Guide | None:
    """TensorRT-LLM's guided_decoding_guide_type + guided_decoding_guide (Triton generate inputs) -> Guide."""
    if guide_type in (None, ""):
        if guide not in (None, ""):
            raise InputError("'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    if guide_type not in TRTLLM_GUIDE_TYPES:
        raise InputError(f"guided_decoding_guide_type {guide_type!r} is not supported "
                         f"({', '.join(TRTLLM_GUIDE_TYPES)} are)")
    kind = TRTLLM_GUIDE_TYPES[guide_type]
    if kind == "json_object":
        if guide not in (None, ""):  # TRT-LLM's "json" takes no guide: any JSON
            raise InputError("guided_decoding_guide_type 'json' takes no guided_decoding_guide "
                             "(use 'json_schema' for a schema)")
        return Guide("json_object")
    if not isinstance(guide, str) or not guide:
        raise InputError(f"guided_decoding_guide_type {guide_type!r} needs a guided_decoding_guide string")
    result = Guide(kind, _json_text(guide, "guided_decoding_guide") if kind == "json_schema" else guide)
    _check(result, "guided_decoding_guide")
    return result


def json_object_input(field: str, value):
    """A vLLM object given as a Triton input: the object itself (inside `sampling_parameters`), or its JSON text
    (a string tensor, possibly in a one-element list)."""
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return _json_text(value, field) if isinstance(value, str) else value


def _json_text(text: str, field: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InputError(f"'{field}' is not valid JSON: {exc}", param=field) from None


def _check(guide: Guide, field: str) -> None:
    try:
        guide.validate()
    except GuideError as exc:
        raise InputError(f"{field}: {exc}", param=field) from None


def _one(found: list[tuple[str, Guide]]) -> Guide | None:
    if len(found) > 1:
        raise InputError(f"give one structured-output guide, got {' and '.join(key for key, _ in found)}",
                         param=found[1][0])
    return found[0][1] if found else None
