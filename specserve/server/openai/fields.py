"""The sampling fields of an OpenAI request (/v1/completions and /v1/chat/completions) as strict pydantic models: a
string is not a number, an integer not a flag, a count out of range is refused, the error naming the field (400,
`param`). The body's other fields (prompt, messages, tools, response_format, ...) pass through to their readers;
fields OpenAI or vLLM define that change nothing here are accepted, as vLLM accepts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specserve.server.errors import InputError
from specserve.server.guides import openai_guide
from specserve.speculative.grammar import Guide
from specserve.speculative.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request (`n`): each is a request of its own to the engine


class _Refused(ValueError):
    """A value the field's type allows and specserve does not do; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    # OpenAI adds options (include_obfuscation) that change nothing here: other keys are ignored
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class SamplingFields(BaseModel):
    """The fields both endpoints share, with their defaults (parse_common drops null fields: null is absent)."""

    model_config = ConfigDict(strict=True, extra="allow")

    max_tokens: Optional[int] = None  # None: the endpoint's default, decided once the prompt length is known
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or less: no top-k
    seed: Optional[int] = None
    stop: list[str] = []  # a string is a list of one
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Optional[int] = None
    num_speculative_tokens: Optional[int] = Field(None, ge=0)  # vLLM's draft length, per request (0: none)
    suffix_cache: bool = True  # false: kept out of the suffix method's shared cache
    user: Optional[str] = None  # OpenAI's end-user id: kept nowhere
    # taken at their neutral value only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop):
        if isinstance(stop, str):
            return [stop]
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return stop
        raise _Refused("stop", "'stop' must be a string or a list of strings")

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key) != 0.0:
                raise _Refused(key, f"'{key}' is not supported by specserve (only 0)")
        if self.repetition_penalty != 1.0:
            raise _Refused("repetition_penalty", "'repetition_penalty' is not supported by specserve (only 1)")
        if self.logit_bias:
            raise _Refused("logit_bias", "'logit_bias' is not supported by specserve")
        if self.best_of not in (None, self.n):
            raise _Refused("best_of", "best_of must equal n: specserve returns every sample it draws")
        if self.stream_options is not None and not self.stream:
            raise _Refused("stream_options", "Stream options can only be defined when `stream=True`.")
        return self


class CompletionFields(SamplingFields):
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: a completion that scores its prompt
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # top log-probabilities per token
    echo: bool = False


class ChatFields(SamplingFields):
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatFields:
        if self.top_logprobs and not self.logprobs:
            raise _Refused("top_logprobs", "top_logprobs needs logprobs: true")
        return self


@dataclass
class CommonFields:
    """What the two endpoints' shared fields ask of a request, defaults applied."""

    max_tokens: int | None  # None: the endpoint's default, decided once the prompt length is known
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool  # the usage so far in every chunk
    n: int  # independent choices
    logprobs: int | None  # top log-probabilities per output token (None: no log-probabilities)
    prompt_logprobs: int | None  # the same for the prompt (completions that echo it)
    num_speculative_tokens: int | None  # the request's cap on draft tokens per step (0: no speculation)
    suffix_cache: bool  # false: out of the suffix method's shared cache
    guide: Guide | None = None  # structured outputs: response_format or vLLM's structured_outputs / guided_*


def parse_common(body: dict, chat: bool) -> CommonFields:
    """The shared fields of a request body (InputError naming the first bad one)."""
    try:
        given = (ChatFields if chat else CompletionFields)(**{k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise _input_error(exc) from None
    if chat:
        max_tokens = given.max_completion_tokens or given.max_tokens
        logprobs = (given.top_logprobs or 0) if given.logprobs else None
        prompt_logprobs = None
    else:
        max_tokens, logprobs = given.max_tokens, given.logprobs
        prompt_logprobs = logprobs if given.echo else None
    options = given.stream_options or StreamOptions()
    return CommonFields(
        max_tokens=max_tokens, temperature=given.temperature, top_p=given.top_p, top_k=max(given.top_k, 0),
        seed=given.seed, stop=[s for s in given.stop if s], stop_token_ids=list(given.stop_token_ids),
        ignore_eos=given.ignore_eos, min_tokens=given.min_tokens, stream=given.stream,
        include_usage=options.include_usage, continuous_usage=options.continuous_usage_stats, n=given.n,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, num_speculative_tokens=given.num_speculative_tokens,
        suffix_cache=given.suffix_cache, guide=openai_guide(body))


def _input_error(exc: ValidationError) -> InputError:
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Refused):
        return InputError(str(cause), param=cause.param)
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    field = ".".join(loc) or "body"
    given = f", got {error['input']!r}" if error["type"] != "missing" else ""
    return InputError(f"'{field}': {error['msg']}{given}", param=loc[-1] if loc else None)
