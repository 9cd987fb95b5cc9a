"""The Triton request and response formats: the inputs of `generate` / `generate_stream` / `infer` in the styles
of the TRT-LLM LLM-API model (`text_input` + `sampling_param_*`), the vLLM backend (`text_input` +
`"parameters": {...}` or a JSON `sampling_parameters`) and the legacy TRT-LLM ensemble (`text_input` +
`max_tokens`, `stop_words`, `end_id`, ...), read into one GenerateRequest; the outputs each style answers with;
and errors as `{"error": "<message>"}`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from specserve.server.errors import CLIENT_CLOSED, InputError, http_status, is_expected
from specserve.server.guides import json_object_input, trtllm_guide, vllm_guide
from specserve.server.http import json_response
from specserve.server.repository import ENSEMBLE, LLMAPI, VLLM, ServedModel
from specserve.server.request import sampling_params
from specserve.speculative.grammar import Guide
from specserve.speculative.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs, json_logprob

STREAMING_NOT_DECOUPLED = "Streaming is only supported in decoupled mode."
UINT64_MAX = 2**64 - 1

# ------------------------------------------------------------------------------------------------------------------
# input values: a tensor's data arrives as a scalar or a (nested) one-element list


def _unwrap(key: str, value):
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise InputError(f"input '{key}' must hold a single element, got {len(value)}")
    if isinstance(value, dict):
        raise InputError(f"parameter '{key}' has invalid type: an object is not allowed")
    return value


def _from_text(key: str, value, parse, what: str):
    """A number sent as text (BYTES tensors, query-style clients) -> the number."""
    if not isinstance(value, str):
        return value
    try:
        return parse(value.strip())
    except ValueError:
        raise InputError(f"'{key}' must be {what}, got {value!r}") from None


def as_int(key: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _from_text(key, _unwrap(key, value), int, "an integer")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"'{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"'{key}' must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InputError(f"'{key}' must be <= {maximum}, got {value}")
    return value


def as_float(key: str, value) -> float:
    value = _from_text(key, _unwrap(key, value), float, "a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"'{key}' must be a number, got {value!r}")
    return float(value)


def as_bool(key: str, value) -> bool:
    value = _unwrap(key, value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise InputError(f"'{key}' must be a boolean, got {value!r}")


def as_str(key: str, value) -> str:
    value = _unwrap(key, value)
    if not isinstance(value, str):
        raise InputError(f"'{key}' must be a string, got {value!r}")
    return value


def as_id(key: str, value) -> int | str:
    """A Triton sequence or request id: an integer or text."""
    value = _unwrap(key, value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"'{key}' must be an integer or a string, got {value!r}")
    return value


def as_str_list(key: str, value) -> list[str]:
    items = value if isinstance(value, list) else [value]
    flat = []
    for item in items:
        for sub in item if isinstance(item, list) else [item]:
            if not isinstance(sub, str):
                raise InputError(f"'{key}' must be a string or a list of strings, got {value!r}")
            if sub:
                flat.append(sub)
    return flat


def as_int_list(key: str, value) -> list[int]:
    items = value if isinstance(value, list) else [value]
    return [as_int(key, item, 0) for item in items]


# ------------------------------------------------------------------------------------------------------------------
# input names: the three styles share one table

# names -> what they set; the llmapi, vLLM and ensemble spellings of one thing share a target
ALIASES = {
    "sampling_param_max_tokens": "max_tokens", "max_tokens": "max_tokens", "request_output_len": "max_tokens",
    "sampling_param_temperature": "temperature", "temperature": "temperature",
    "sampling_param_top_p": "top_p", "top_p": "top_p", "runtime_top_p": "top_p",
    "sampling_param_top_k": "top_k", "top_k": "top_k", "runtime_top_k": "top_k",
    "sampling_param_seed": "seed", "seed": "seed", "random_seed": "seed",
    "sampling_param_stop": "stop", "stop_words": "stop",
    "sampling_param_exclude_input_from_output": "exclude", "exclude_input_in_output": "exclude",
    "sampling_param_return_perf_metrics": "return_perf_metrics", "return_perf_metrics": "return_perf_metrics",
    "min_tokens": "min_tokens", "min_length": "min_tokens",
    "ignore_eos": "ignore_eos", "streaming": "streaming", "stream": "stream",
    "num_speculative_tokens": "num_speculative_tokens", "suffix_cache": "suffix_cache", "logprobs": "logprobs",
}
RETURN_FLAGS = {"return_finish_reason", "return_stop_reason", "return_num_input_tokens", "return_num_output_tokens",
                "return_cumulative_logprob", "return_logprobs", "return_log_probs"}
# the returns (RETURN_FLAGS without "return_") that need the output tokens' log-probabilities
LOGPROB_RETURNS = {"cumulative_logprob", "logprobs", "log_probs"}
UNSUPPORTED_FLAGS = {"return_context_logits", "return_generation_logits", "return_kv_cache_reuse_stats"}
MUST_BE_ONE = {"sampling_param_best_of", "best_of", "n", "num_return_sequences", "beam_width"}
NEUTRAL_FLOATS = {"sampling_param_frequency_penalty": 0.0, "frequency_penalty": 0.0,
                  "sampling_param_presence_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
                  "repetition_penalty": 1.0, "length_penalty": 1.0}
IGNORED = {**dict.fromkeys(("pad_id", "priority", "timeout", "cancellation_check_period_ms"), as_int),
           **dict.fromkeys(("spaces_between_special_tokens", "detokenize", "binary_data_output", "sequence_start",
                            "sequence_end", "triton_enable_empty_final_response"), as_bool),
           "model": as_str, "lora_name": as_str, "sequence_id": as_id}  # inputs without effect, checked still
UNSUPPORTED_INPUTS = {"image", "image_url", "lora_id", "lora_path", "lora_ckpt_source", "lora_task_id",
                      "lora_weights", "lora_config", "embedding_request", "prompt_embedding_table",
                      "prompt_table_extra_id", "prompt_vocab_size", "decoder_text_input", "embedding_bias_words",
                      "embedding_bias_weights",
                      "sampling_param_logits_post_processor_name", "logit_bias", "allowed_token_ids"}
# structured outputs: TRT-LLM's guide inputs, and vLLM's SamplingParams objects (in `sampling_parameters`)
GUIDE_INPUTS = {"guided_decoding_guide_type", "guided_decoding_guide", "structured_outputs", "guided_decoding"}
DEFAULT_MAX_TOKENS = {LLMAPI: 32, VLLM: 16, ENSEMBLE: None}  # LLM-API SamplingParams / vLLM defaults
DEFAULT_TEMPERATURE = {LLMAPI: 0.0, VLLM: 1.0, ENSEMBLE: 0.0}  # TRT-LLM samples greedily unless told
# inputs setting one SamplingParams field or flag (by the name ALIASES gives them) and the type they must have
SETTINGS = {"max_tokens": as_int, "temperature": as_float, "top_p": as_float, "top_k": as_int,
            "seed": lambda key, value: as_int(key, value, 0, UINT64_MAX),
            "min_tokens": lambda key, value: as_int(key, value, 0),
            "ignore_eos": as_bool, "exclude": as_bool, "streaming": as_bool, "stream": as_bool,
            "num_speculative_tokens": lambda key, value: as_int(key, value, 0), "suffix_cache": as_bool,
            "logprobs": lambda key, value: as_int(key, value, 0, MAX_LOGPROBS)}


def _checked_only(key: str, value) -> bool:
    """An input without effect here (IGNORED), still held to its type: InputError naming it otherwise."""
    IGNORED[key](key, value)
    return False


# inputs accepted only at a neutral value: (names, refused(key, value), message)
REFUSED = (
    (UNSUPPORTED_FLAGS, as_bool, "'{key}' is not supported by specserve (no logits or cache statistics)"),
    (MUST_BE_ONE, lambda key, value: as_int(key, value) != 1,
     "'{key}' must be 1: specserve returns one sequence per request"),
    (NEUTRAL_FLOATS, lambda key, value: as_float(key, value) != NEUTRAL_FLOATS[key],
     "'{key}' is not supported by specserve (only {neutral})"),
    ({"bad_words"}, lambda key, value: bool(as_str_list(key, value)), "'bad_words' is not supported by specserve"),
    ({"skip_special_tokens"}, lambda key, value: not as_bool(key, value),
     "'skip_special_tokens' = false is not supported by specserve"),
    ({"include_stop_str_in_output"}, as_bool, "'include_stop_str_in_output' = true is not supported by specserve"),
    ({"prompt_logprobs"}, lambda key, value: value not in (None, 0, False),
     "'{key}' is not supported by specserve's Triton routes (OpenAI completions score prompts: echo + logprobs)"),
    (IGNORED, _checked_only, ""),
    (UNSUPPORTED_INPUTS, lambda key, value: value not in (None, "", [], [""]),
     "input '{key}' is not supported by specserve"),
)


# ------------------------------------------------------------------------------------------------------------------
# requests


@dataclass
class GenerateRequest:
    prompt: str = ""
    params: SamplingParams | None = None  # None for a cancel request
    stream: bool = False  # several responses (streaming / stream = true)
    cumulative: bool = False  # llmapi `streaming`: each response repeats the whole text so far
    exclude_input: bool | None = None
    returns: set[str] = field(default_factory=set)  # optional outputs asked for: finish_reason, perf_metrics, ...
    cancel: bool = False  # llmapi `stop: true`: cancel the in-flight requests with this request's id
    request_id: str = ""
    top_logprobs: int | None = None  # vLLM's `logprobs`: top tokens per output token (None: `logprobs` is null)


@dataclass
class _Inputs:
    """The inputs of one request as read, before the defaults of its style apply."""

    prompt: str = ""
    settings: dict = field(default_factory=dict)  # SETTINGS targets -> values
    stop: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    returns: set[str] = field(default_factory=set)
    cancel: bool = False
    guides: dict = field(default_factory=dict)  # structured-output inputs (GUIDE_INPUTS) as given


def request_id(body: dict) -> str:
    rid = body.get("id", "")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise InputError("'id' must be a string")
    return str(rid)


def flatten_body(body: dict) -> dict:
    """Triton's exact mapping: top-level keys and the keys of the nested "parameters" object, one namespace."""
    params = body.get("parameters", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InputError("'parameters' must be a JSON object")
    return {**params, **{k: v for k, v in body.items() if k not in ("parameters", "id")}}


def parse_generate(values: dict, model: ServedModel, rid: str = "") -> GenerateRequest:
    """The flattened inputs of a generate / infer request -> GenerateRequest; InputError names the bad key."""
    values = _with_sampling_parameters(values)
    inputs = _Inputs()
    for key, value in values.items():
        _read_input(inputs, key, value, model)
    _check_required(values, inputs, model)
    return _generate_request(inputs, model, rid)


def _with_sampling_parameters(values: dict) -> dict:
    """vLLM's `sampling_parameters`, a JSON-encoded dict of SamplingParams fields, merged under the other inputs."""
    extra = values.get("sampling_parameters")
    if extra is None:
        return values
    try:
        extra = json.loads(as_str("sampling_parameters", extra))
    except ValueError as exc:
        raise InputError(f"'sampling_parameters' is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise InputError("'sampling_parameters' must be a JSON object")
    return {**extra, **{k: v for k, v in values.items() if k != "sampling_parameters"}}


def _read_input(inputs: _Inputs, key: str, value, model: ServedModel) -> None:
    target = ALIASES.get(key)
    if key == "text_input":
        if isinstance(value, list) and len(value) > 1:
            raise InputError("text_input must hold a single prompt (batched prompts are not supported)")
        inputs.prompt = as_str(key, value)
    elif target in SETTINGS:
        inputs.settings[target] = SETTINGS[target](key, value)
    elif key == "stop" and (model.kind != VLLM or isinstance(_first(value), bool)):
        inputs.cancel = as_bool(key, value)  # TRT-LLM's BOOL `stop` cancels; vLLM's `stop` holds stop strings
    elif target == "stop" or key == "stop":
        inputs.stop += as_str_list(key, value)
    elif key == "stop_token_ids":
        inputs.stop_ids += as_int_list(key, value)
    elif key == "end_id":
        inputs.stop_ids.append(as_int(key, value, 0))
    elif key in GUIDE_INPUTS:
        inputs.guides[key] = _unwrap(key, value) if key.startswith("guided_decoding_guide") \
            else json_object_input(key, value)
    elif target == "return_perf_metrics" or key in RETURN_FLAGS:
        if as_bool(key, value):
            inputs.returns.add("perf_metrics" if target == "return_perf_metrics" else key.removeprefix("return_"))
    elif not _accepted_at_neutral(key, value):
        raise InputError(f"unexpected inference input '{key}' for model '{model.name}'")


def _accepted_at_neutral(key: str, value) -> bool:
    """Whether `key` is an input specserve takes only at its neutral value; InputError when it is set otherwise."""
    for names, refused, message in REFUSED:
        if key in names:
            if refused(key, value):
                raise InputError(message.format(key=key, neutral=NEUTRAL_FLOATS.get(key)))
            return True
    return False


def _check_required(values: dict, inputs: _Inputs, model: ServedModel) -> None:
    """text_input, and max_tokens for the ensemble (a cancel request needs neither)."""
    if inputs.cancel:
        return
    if "text_input" not in values:
        raise _missing("text_input", model)
    if model.kind == ENSEMBLE and "max_tokens" not in inputs.settings:
        raise _missing("max_tokens", model)


def _missing(name: str, model: ServedModel) -> InputError:
    return InputError(f"expected input '{name}' for model '{model.name}': missing required input(s) ['{name}']")


def _generate_request(inputs: _Inputs, model: ServedModel, rid: str) -> GenerateRequest:
    kind, settings = model.kind, inputs.settings
    # llmapi's `streaming` repeats the cumulative text (the LLM API's quirk); `stream` sends deltas
    req = GenerateRequest(prompt=inputs.prompt, returns=inputs.returns, cancel=inputs.cancel, request_id=rid,
                          stream=bool(settings.get("streaming") or settings.get("stream")),
                          cumulative=bool(settings.get("streaming")) and kind == LLMAPI,
                          exclude_input=settings.get("exclude"), top_logprobs=settings.get("logprobs"))
    if req.stream and not model.source.decoupled:
        raise InputError(STREAMING_NOT_DECOUPLED)
    if kind == VLLM and req.stream and req.exclude_input is False:
        raise InputError("When streaming, `exclude_input_in_output` = False is not allowed.")
    if not req.cancel:
        req.params = sampling_params(
            max_tokens=settings.get("max_tokens", DEFAULT_MAX_TOKENS[kind]),
            temperature=settings.get("temperature", DEFAULT_TEMPERATURE[kind]), top_p=settings.get("top_p", 1.0),
            top_k=settings.get("top_k", 0), seed=settings.get("seed"), stop=inputs.stop,
            stop_token_ids=inputs.stop_ids, ignore_eos=settings.get("ignore_eos", False),
            min_tokens=settings.get("min_tokens", 0),
            num_speculative_tokens=settings.get("num_speculative_tokens"),
            suffix_cache=settings.get("suffix_cache", True), guide=_guide(inputs.guides),
            logprobs=_logprobs_to_compute(req))
    return req


def _logprobs_to_compute(req: GenerateRequest) -> int | None:
    """The engine's `logprobs` (top tokens per output token) for what the request returns: None when it returns
    no log-probability, the sampled token's alone (0) for cumulative ones."""
    asked = req.returns & LOGPROB_RETURNS
    if not asked:
        return None
    return req.top_logprobs or 0 if "logprobs" in asked else 0


def _guide(given: dict) -> Guide | None:
    """The one structured-output guide of a request's inputs (TRT-LLM's or vLLM's spelling), or None."""
    found = [(key, vllm_guide(given[key], key)) for key in ("structured_outputs", "guided_decoding")
             if given.get(key) is not None]
    trtllm = trtllm_guide(given.get("guided_decoding_guide_type"), given.get("guided_decoding_guide"))
    found = [(key, guide) for key, guide in found if guide is not None]
    if trtllm is not None:
        found.append(("guided_decoding_guide_type", trtllm))
    if len(found) > 1:
        raise InputError(f"give one structured-output guide, got {' and '.join(key for key, _ in found)}")
    return found[0][1] if found else None


def _first(value):
    while isinstance(value, list) and value:
        value = value[0]
    return value


# ------------------------------------------------------------------------------------------------------------------
# responses


def echoes_prompt(req: GenerateRequest) -> bool:
    """Whether text_output starts with the prompt: non-streaming responses of all three styles (unless excluded),
    and llmapi's cumulative streaming."""
    if req.exclude_input:
        return False
    return not req.stream or req.cumulative


def stop_reason(result, params: SamplingParams, tokenizer) -> str:
    if result.finish_reason != "stop":
        return "None"
    if result.token_ids and result.token_ids[-1] in params.stop_token_ids:
        return str(result.token_ids[-1])
    if params.stop:
        full = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        hits = [(full.find(s), s) for s in params.stop if s in full]
        if hits:
            return min(hits)[1]
    return "None"


def response_head(model: ServedModel, req: GenerateRequest) -> dict:
    head = {"model_name": model.name, "model_version": model.version}
    if req.request_id:
        head["id"] = req.request_id
    return head


def build_outputs(model: ServedModel, req: GenerateRequest, text: str, new_tokens: int, prompt_tokens: int,
                  result=None, timing=None, scored: list[TokenLogprobs] = (), cumulative: float = 0.0) -> dict:
    """One response's outputs and response parameters, {name: value} (values are JSON scalars, or lists of them
    for multi-element tensors). `scored`: the log-probabilities of this response's tokens; `cumulative`: their
    sum over the whole output so far."""
    out: dict = {"text_output": text}
    if model.kind == ENSEMBLE:  # response parameters the ensemble scheduler adds
        out.update(sequence_end=False, sequence_id=0, sequence_start=False)
    if "finish_reason" in req.returns:
        out["finish_reason"] = str(result.finish_reason) if result else "None"
    if "stop_reason" in req.returns:
        out["stop_reason"] = stop_reason(result, req.params, model.engine.tokenizer) if result else "None"
    if "num_input_tokens" in req.returns:
        out["num_input_tokens"] = prompt_tokens
    if "num_output_tokens" in req.returns:
        out["num_output_tokens"] = new_tokens
    if "perf_metrics" in req.returns and result is not None:
        out.update(_perf_metrics(model, result, timing))
    out.update(_logprob_outputs(model, req, scored, cumulative))
    return out


def _logprob_outputs(model: ServedModel, req: GenerateRequest, scored: list[TokenLogprobs], cumulative: float) -> dict:
    """Each backend's log-probability outputs: vLLM's `cumulative_logprob` (FP32; the LLM API's is BYTES) and
    `logprobs` (JSON: per token {token id: {logprob, rank, decoded_token}} for the sampled token and the top
    `logprobs`, null when the request set no `logprobs`), the TRT-LLM ensemble's `cum_log_probs` and
    `output_log_probs` (one float per token of this response)."""
    out: dict = {}
    if "cumulative_logprob" in req.returns:
        out["cumulative_logprob"] = cumulative if model.kind == VLLM else str(cumulative)
    if "logprobs" in req.returns:
        decoded = model.engine.tokenizer.decode
        out["logprobs"] = "null" if req.top_logprobs is None else json.dumps(
            [_vllm_token_logprobs(entry, decoded) for entry in scored])
    if "log_probs" in req.returns:
        out["cum_log_probs"] = cumulative
        out["output_log_probs"] = [json_logprob(entry.logprob) for entry in scored]
    return out


def _vllm_token_logprobs(entry: TokenLogprobs, decoded) -> dict:
    """vLLM's per-token dict: the sampled token with its rank, then the top tokens, keyed by token id."""
    ranked = [(entry.token, entry.logprob, entry.rank)] + [(t, lp, i + 1) for i, (t, lp) in enumerate(entry.top)]
    out: dict = {}
    for token, logprob, rank in ranked:
        out.setdefault(str(token), {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": decoded([token])})
    return out


def _perf_metrics(model: ServedModel, result, timing) -> dict:
    m = result.metrics
    perf = {"arrival_time_ns": timing.arrival_ns, "first_scheduled_time_ns": timing.started_ns,
            "first_token_time_ns": timing.first_token_ns, "last_token_time_ns": timing.last_token_ns,
            "acceptance_rate": float(m.acceptance_rate),
            "total_accepted_draft_tokens": m.total_accepted_draft_tokens,
            "total_draft_tokens": m.total_draft_tokens,
            "acceptance_length": float(m.acceptance_length)}  # specserve extra: tokens per target forward
    if model.kind == LLMAPI:  # the LLM-API model sends these as BYTES tensors: JSON strings
        perf = {k: str(v) for k, v in perf.items()}
    return perf


# ------------------------------------------------------------------------------------------------------------------
# errors


def error_json(message: str, status: int = 400, headers: dict | None = None) -> Response:
    return json_response({"error": message}, status, headers=headers)


def error_message(model: ServedModel | None, exc: BaseException) -> str:
    """The client's message: an expected error's own text; a failure prefixed as the model's backend does."""
    if is_expected(exc) or model is None:
        return str(exc)
    prefix = {LLMAPI: "Error generating request: ", VLLM: "Error generating stream: ", ENSEMBLE: ""}[model.kind]
    return f"{prefix}{exc}"


def error_response(model: ServedModel | None, exc: BaseException) -> Response:
    status = http_status(exc)
    if status == CLIENT_CLOSED:
        return Response(status_code=status)
    return error_json(error_message(model, exc), status)


def resolve_model(request: Request) -> ServedModel:
    """The ready model a /v2/models/<name>[/versions/<version>] path names (RepositoryError: 404 / 503)."""
    params = request.path_params
    return request.app.state.ctx.repository.get(params["model"], params.get("version"))
