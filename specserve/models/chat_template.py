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

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from specserve.checks import ConfigError
from specserve.files import write_text_atomically

END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>")
EMBEDDED_DEFAULT_TEMPLATE = "question_answer.jinja"
EMBEDDED_DEFAULT_STOP = ("\nQuestion:",)  # where the base model would ask the next question itself
GGUF_TEMPLATE_FILE = "gguf_chat_template.json"  # the GGUF's field (or its absence), kept in its converted checkpoint


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
    from gguf import GGUFValueType

    from specserve.models import gguf_file

    field = gguf_file.read(gguf_path).fields.get("tokenizer.chat_template")
    if field is None or field.types[:1] != [GGUFValueType.STRING]:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def kept_gguf_chat_template(gguf_path: Path, directory: Path) -> str | None:
    """gguf_chat_template, read once and then kept in `directory` (the GGUF's converted checkpoint, whose name
    changes with the file): reading one field parses every metadata entry, the whole vocabulary included, which
    took ~25 s of each start of the embedded default (262k tokens, and no template in the end)."""
    kept = directory / GGUF_TEMPLATE_FILE
    try:
        template = json.loads(kept.read_text(encoding="utf-8"))["template"]
        if template is None or isinstance(template, str):
            return template
    except (OSError, ValueError, KeyError, TypeError):
        pass
    template = gguf_chat_template(gguf_path)
    try:
        write_text_atomically(kept, json.dumps({"template": template}))
    except OSError:  # a read-only cache: the next start reads the GGUF again
        pass
    return template


def resolve_chat_format(tokenizer, gguf_path: Path | None, embedded_default: bool,
                        directory: Path | None = None) -> ChatFormat:
    """The checkpoint's template, else the GGUF's (kept in `directory`, its converted checkpoint, when given), else
    the shipped one for the embedded default, else none."""
    own = getattr(tokenizer, "chat_template", None)
    if not own and gguf_path:
        own = kept_gguf_chat_template(gguf_path, directory) if directory else gguf_chat_template(gguf_path)
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


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt asked as one user message: the text of the model's chat template, which every runner tokenizes
    as it tokenizes a prompt, into the ids /v1/chat/completions makes of that message (a template that writes the
    BOS its tokenizer adds anyway leaves it to the tokenizer). ConfigError for a model without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--chat: this model has no chat template")
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]
    texts = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        texts.append(text[len(bos):] if adds_bos and text.startswith(bos) else text)
    return texts
