"""A chat request's `messages` -> the token ids of its prompt, through the model's chat template.

Messages are checked and passed to the template in the form OpenAI clients send and templates expect (as
transformers and vLLM pass them): `content` as text (text parts joined), an assistant's `tool_calls` with their
`arguments` parsed from their JSON text (templates write them with `tojson`), and a `tool` message's
`tool_call_id`, which must answer a call an assistant made earlier in the conversation.
"""

from __future__ import annotations

import json

from specserve.server.errors import InputError


def chat_prompt(body: dict, engine, max_messages: int, chat_template: str | None = None,
                tools: list[dict] | None = None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("'messages' must be a non-empty list", param="messages")
    if len(messages) > max_messages:
        raise InputError(f"'messages' has {len(messages)} messages; at most {max_messages} are allowed",
                         param="messages")
    conversation = template_messages(messages)
    tokenizer = engine.tokenizer
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputError("this model has no chat template: start the server with --chat-template FILE, or send "
                         "the prompt to /v1/completions", param="messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InputError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **({"tools": tools} if tools else {}),
                                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises for conversations the template refuses
        raise InputError(f"cannot apply the chat template: {exc}", param="messages") from None
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise InputError("the conversation is empty", param="messages")
    return ids


def template_messages(messages: list) -> list[dict]:
    """The messages as the chat template takes them (InputError naming the message that is wrong)."""
    called: set[str] = set()
    out = []
    for index, message in enumerate(messages):
        role, content = message_text(message, index)
        entry = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = [_tool_call(call, f"messages[{index}].tool_calls[{i}]")
                                   for i, call in enumerate(_list(message["tool_calls"], index))]
            called.update(call["id"] for call in entry["tool_calls"])
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise InputError(f"messages[{index}]: a tool message needs the tool_call_id of an earlier "
                                 f"assistant tool call, got {call_id!r}", param="messages")
            entry["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def message_text(message, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise InputError(f"messages[{index}] must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InputError(f"messages[{index}].role must be a string", param="messages")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InputError(f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return role, "".join(parts)
    raise InputError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def _list(value, index: int) -> list:
    if not isinstance(value, list):
        raise InputError(f"messages[{index}].tool_calls must be a list", param="messages")
    return value


def _tool_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(call.get("id"), str) \
            or not isinstance(function.get("name"), str):
        raise InputError(f"{where} must have an id and a function with a name", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise InputError(f"{where}.function.arguments is not valid JSON", param="messages") from None
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}
