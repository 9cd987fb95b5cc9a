"""Chat templates: the model's own, the GGUF's, the embedded default's, --chat-template, and a 400 without one."""

from __future__ import annotations

import openai
import pytest
from gguf import GGUFWriter

from specserve.models.chat_template import (EMBEDDED_DEFAULT_STOP, ChatFormat, ChatTemplateError, end_of_turn_ids,
                                            gguf_chat_template, kept_gguf_chat_template, read_template_file,
                                            resolve_chat_format)
from specserve.server.openai.tool_calls import template_format
from specserve.server.repository import ModelRepository
from tests.conftest import build_tokenizer, make_checkpoint

from ..conftest import start_server
from ..test_cli import invoke

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
OVERRIDE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}ANSWER:"


def one_model_repository(root, model_dir):
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.yaml").write_text(f"model: {model_dir}\ndtype: float32\n")
    return ModelRepository.from_directory(root)


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory):
    """A server of one model whose tokenizer has no chat template, and its client."""
    model_dir = make_checkpoint(tmp_path_factory.mktemp("bare"), "llama", tokenizer=build_tokenizer(None))
    running = start_server(one_model_repository(tmp_path_factory.mktemp("repo"), model_dir))
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield running, client
    client.close()
    running.close()


@pytest.fixture(scope="module")
def overridden(tmp_path_factory):
    """The same kind of model behind a server started with a chat template override."""
    model_dir = make_checkpoint(tmp_path_factory.mktemp("bare2"), "llama", tokenizer=build_tokenizer(None))
    running = start_server(one_model_repository(tmp_path_factory.mktemp("repo2"), model_dir),
                           chat_template=OVERRIDE)
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield running, client
    client.close()
    running.close()


def test_a_model_without_a_template_gets_a_clear_400(untemplated):
    running, client = untemplated
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert "no chat template" in str(caught.value) and "--chat-template" in str(caught.value)
    assert client.completions.create(model="m", prompt="def add(a, b):", max_tokens=4).choices[0].text is not None


def test_the_override_renders_the_conversation(overridden):
    running, client = overridden
    rendered = "<<system>>Be brief.<<user>>def add(a, b):ANSWER:"
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)
    tokenizer = running.repository.models["m"].engine.tokenizer
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert chat.usage.prompt_tokens == len(ids)
    completion = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_the_models_own_template_is_used(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=8, temperature=0)
    tokenizer = server.repository.models["plain"].engine.tokenizer
    rendered = "<s>system: Be brief.\nuser: def add(a, b):\nassistant:"
    assert chat.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False).input_ids)
    client.close()


def test_a_template_that_refuses_the_conversation_is_a_400(overridden):
    running, client = overridden
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": "x"}})
    assert caught.value.status_code == 400


def embedded_default_format():
    return resolve_chat_format(build_tokenizer(None), None, embedded_default=True)


def test_the_embedded_defaults_format_is_a_question_and_answer_transcript():
    tokenizer = build_tokenizer(None)
    tokenizer.chat_template = embedded_default_format().template
    conversation = MESSAGES + [{"role": "assistant", "content": "return a + b"}, {"role": "user", "content": "ok"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == "<s>Be brief.\n\nQuestion: def add(a, b):\nAnswer: return a + b\nQuestion: ok\nAnswer:"
    assert embedded_default_format().stop == EMBEDDED_DEFAULT_STOP == ("\nQuestion:",)
    with pytest.raises(Exception, match="not 'robot'"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_the_embedded_defaults_format_lists_tools_and_writes_calls_as_hermes_does():
    tokenizer = build_tokenizer(None)
    tokenizer.chat_template = embedded_default_format().template
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": {}}}
    conversation = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c", "content": "noon"}]
    text = tokenizer.apply_chat_template(conversation, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith('<s>Functions you may call, one JSON object each:\n{"name": "now", "parameters": ')
    assert text.endswith('Question: Time?\nAnswer: <tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
                         "Result: noon\nAnswer:")
    assert template_format(tokenizer.chat_template).name == "hermes"


def write_gguf(path, template: str | None):
    writer = GGUFWriter(str(path), "llama")
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_resolution_order(tmp_path):
    path = write_gguf(tmp_path / "with-template.gguf", "{{ 'from the gguf' }}")
    assert gguf_chat_template(path) == "{{ 'from the gguf' }}"
    own = build_tokenizer()
    assert resolve_chat_format(own, path, embedded_default=True) == ChatFormat(own.chat_template)
    bare = build_tokenizer(None)
    assert resolve_chat_format(bare, path, embedded_default=True) == ChatFormat("{{ 'from the gguf' }}")
    assert resolve_chat_format(bare, None, embedded_default=True) == embedded_default_format()
    assert resolve_chat_format(bare, None, embedded_default=False) == ChatFormat(None)


@pytest.mark.parametrize("template", ["{{ 'from the gguf' }}", None])
def test_the_gguf_template_is_read_once_then_kept_beside_the_checkpoint(tmp_path, monkeypatch, template):
    """Reading the GGUF's field parses all its metadata (the whole vocabulary): the field, or its absence, is kept
    in the converted checkpoint's directory and read from there on later starts."""
    from specserve.models import chat_template

    gguf = write_gguf(tmp_path / "model.gguf", template)
    converted = tmp_path / "converted"
    converted.mkdir()
    reads = []
    read = chat_template.gguf_chat_template
    monkeypatch.setattr(chat_template, "gguf_chat_template", lambda path: reads.append(path) or read(path))
    bare = build_tokenizer(None)
    for _ in range(3):
        assert kept_gguf_chat_template(gguf, converted) == template
        assert resolve_chat_format(bare, gguf, embedded_default=False, directory=converted) == ChatFormat(template)
    assert reads == [gguf]
    (converted / chat_template.GGUF_TEMPLATE_FILE).write_text('{"template": 7}')  # not a template: read again
    assert kept_gguf_chat_template(gguf, converted) == template and len(reads) == 2
    unwritable = tmp_path / "missing"  # the answer is still the GGUF's, and nothing is left behind
    assert kept_gguf_chat_template(gguf, unwritable) == template and not unwritable.exists()


def test_end_of_turn_tokens_are_found_by_name():
    tokenizer = build_tokenizer()
    assert end_of_turn_ids(tokenizer) == set()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    assert end_of_turn_ids(tokenizer) == {tokenizer.convert_tokens_to_ids("<end_of_turn>")}


def test_template_files_are_checked(tmp_path):
    good = tmp_path / "good.jinja"
    good.write_text(OVERRIDE)
    assert read_template_file(good) == OVERRIDE
    for name, text, message in (("missing.jinja", None, "cannot read"), ("empty.jinja", " \n", "empty"),
                                ("bad.jinja", "{% for m in messages %}", "not valid Jinja")):
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ChatTemplateError, match=message):
            read_template_file(tmp_path / name)
    result = invoke("serve", "--model", "unused", "--chat-template", tmp_path / "missing.jinja")
    assert result.exit_code == 2 and "cannot read the chat template" in result.output
