"""Which chat template renders a model's conversations, and which tokens end a turn.

The template is, first found: the server's `--chat-template FILE` (applied at request time, see
server/openai/protocol.py), the checkpoint's own (`tokenizer_config.json` or `chat_template.jinja`, read by
transformers), the GGUF's `tokenizer.chat_template` field (transformers' GGUF conversion drops it), and last, for
the embedded default only, the question-and-answer format specserve ships (its GGUF has no template, and it is a
base model). A model with none of these has no chat: its chat requests get a 400 that says how to give one, never
a made-up transcript.

A GGUF carries no generation config, so the tokens that end a chat turn (`<end_of_turn>`, `<|im_end|>`, ...) are
found in its vocabulary by name, as llama.cpp marks its end-of-generation tokens; without them a chat answer would
run on into invented turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>")
EMBEDDED_DEFAULT_TEMPLATE = "question_answer.jinja"
EMBEDDED_DEFAULT_STOP = ("\nQuestion:",)  # where the base model would ask the next question itself


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat template and the stop strings its chat answers get (a template that ends turns in plain
    text, not with an end-of-turn token, needs them)."""

    template: str | None
    stop: tuple[str, ...] = ()


class ChatTemplateError(ValueError):
    """A --chat-template file that cannot be read or is not a template."""


def gguf_chat_template(gguf_path: Path) -> str | None:
    """The GGUF's `tokenizer.chat_template` field, if it has one."""
    from gguf import GGUFReader, GGUFValueType

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None or field.types[:1] != [GGUFValueType.STRING]:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def resolve_chat_format(tokenizer, gguf_path: Path | None, embedded_default: bool) -> ChatFormat:
    """The checkpoint's template, else the GGUF's, else the shipped one for the embedded default, else none."""
    own = getattr(tokenizer, "chat_template", None) or (gguf_chat_template(gguf_path) if gguf_path else None)
    if own:
        return ChatFormat(own)
    if embedded_default:
        template = files("specserve.models").joinpath("chat_templates", EMBEDDED_DEFAULT_TEMPLATE).read_text()
        return ChatFormat(template, EMBEDDED_DEFAULT_STOP)
    return ChatFormat(None)


def end_of_turn_ids(tokenizer) -> set[int]:
    """Ids of the vocabulary's end-of-turn tokens (by their text)."""
    vocab = tokenizer.get_vocab()
    return {vocab[text] for text in END_OF_TURN_TOKENS if text in vocab}


def read_template_file(path: str | Path) -> str:
    """A --chat-template file's text, checked to compile as a Jinja template."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read the chat template {path}: {exc}") from None
    if not text.strip():
        raise ChatTemplateError(f"the chat template {path} is empty")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template {path} is not valid Jinja (line {exc.lineno}: {exc.message})"
                                ) from None
    return text
