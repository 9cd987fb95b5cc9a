"""logprobs, top_logprobs, echo + logprobs with max_tokens 0 (prompt scoring), and n, through the openai client:
the numbers are the model's own (a direct forward), the same through a speculating model and a plain one."""

from __future__ import annotations

import openai
import pytest
import torch

from specserve.models.kv_cache import KVCache
from specserve.speculative.sampling import SamplingParams
from tests.server.openai.test_http import PROMPT, client  # noqa: F401 - the fixture


def direct_logprobs(server, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of `ids`, in one plain forward [len(ids), V]."""
    model = server.repository.models["plain"].engine.model
    positions = torch.arange(len(ids))[None]
    logits = model(torch.tensor([ids]), positions, KVCache.for_model(model, 1, len(ids)), positions).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_completion_logprobs_are_the_models_with_and_without_speculation(client, server):  # noqa: F811
    outs = {name: client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
            for name in ("plain", "tensorrt_llm")}
    plain, drafted = outs["plain"].choices[0], outs["tensorrt_llm"].choices[0]
    assert drafted.text == plain.text
    assert drafted.logprobs.tokens == plain.logprobs.tokens
    assert drafted.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    engine = server.repository.models["plain"].engine
    prompt_ids = engine.encode(PROMPT)
    output_ids = engine.generate(PROMPT, SamplingParams(max_tokens=12)).token_ids  # the server is idle now
    want = direct_logprobs(server, prompt_ids + output_ids)[len(prompt_ids) - 1:-1]
    got = torch.tensor(plain.logprobs.token_logprobs)
    assert torch.allclose(got, want.max(-1).values, atol=1e-3)  # greedy: each token is the most likely one
    for top, row in zip(plain.logprobs.top_logprobs, want):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(float(row.max()), abs=1e-3)
    offsets = plain.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_echo_with_max_tokens_0_scores_the_prompt(client, server):  # noqa: F811
    out = client.completions.create(model="tensorrt_llm", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    prompt_ids = server.repository.models["plain"].engine.encode(PROMPT)
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids) and choice.logprobs.token_logprobs[0] is None
    want = direct_logprobs(server, prompt_ids)[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs[1:]), want, atol=1e-3)
    assert choice.logprobs.top_logprobs[0] is None and all(len(t) == 1 for t in choice.logprobs.top_logprobs[1:])


def test_chat_logprobs_and_streamed_logprobs(client):  # noqa: F811
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model="tensorrt_llm", messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
    assert all(item.bytes == list(item.token.encode()) for item in content)
    streamed = []
    for part in client.chat.completions.create(model="tensorrt_llm", messages=messages, max_tokens=8,
                                               temperature=0, logprobs=True, top_logprobs=2, stream=True):
        if part.choices and part.choices[0].logprobs:
            streamed += part.choices[0].logprobs.content
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tensorrt_llm", messages=messages, max_tokens=2, top_logprobs=2)


def test_n_choices_are_independent_seeded_samples(client):  # noqa: F811
    def ask(**extra):
        return client.completions.create(model="tensorrt_llm", prompt=PROMPT, max_tokens=10, temperature=1.0,
                                         seed=5, **extra)

    four = ask(n=4, logprobs=0)
    assert sorted(c.index for c in four.choices) == [0, 1, 2, 3]
    texts = [c.text for c in sorted(four.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # independent samples
    assert texts == [c.text for c in sorted(ask(n=4).choices, key=lambda c: c.index)]  # seeded
    assert texts[0] == ask().choices[0].text  # choice 0 is the request's own seed
    assert four.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in four.choices)
    assert four.usage.prompt_tokens == ask().usage.prompt_tokens  # the prompt counts once
    streamed = {}
    for part in ask(n=4, stream=True):
        for c in part.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.text or "")
    assert [streamed[i] for i in range(4)] == texts
