"""Triton / KServe v2 HTTP: health, metadata, config, statistics, the repository extension, `infer`, and the
generate extension (`generate`, `generate_stream`) with the request styles of the TRT-LLM LLM-API model
(`text_input` + `sampling_param_*`), the vLLM backend (`text_input` + `"parameters": {...}`) and the legacy
TRT-LLM ensemble (`text_input` + `max_tokens`, `stop_words`, `end_id`, ...).

Errors are `{"error": "<message>"}` with Triton's status codes (400 bad input, 404 unknown model, 503 not ready /
queue full, 405 wrong method).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import math
import struct
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response
from starlette.convertors import Convertor, register_url_convertor
from starlette.routing import Route

from specserve.engine.engine import RequestError
from specserve.server.http import (ClientDisconnected, EventStream, RequestStream, ServerContext, json_response,
                                   sse, with_disconnect)
from specserve.server.repository import ENSEMBLE, LLMAPI, VLLM, RepositoryError, ServedModel
from specserve.server.runner import RunnerError
from specserve.speculative.sampling import SamplingParams

SERVER_NAME = "specserve"
EXTENSIONS = ["model_repository", "model_configuration", "binary_tensor_data", "parameters", "statistics",
              "generate"]
MULTI_RESPONSE_ERROR = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                        "generates various number of responses")
STREAMING_NOT_DECOUPLED = "Streaming is only supported in decoupled mode."
UINT64_MAX = 2**64 - 1


class _VersionConvertor(Convertor):
    """Triton's model version path segment: digits, kept as a string."""

    regex = "[0-9]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value) -> str:
        return str(value)


register_url_convertor("int_str", _VersionConvertor())


class InputError(Exception):
    """A bad request body: 400 with the message."""

    status = 400


# ------------------------------------------------------------------------------------------------------------------
# model inputs / outputs as each backend declares them (config.pbtxt); used by metadata, config and `infer`


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str  # KServe datatype: BYTES, BOOL, INT32, UINT64, FP32, ...
    dims: tuple[int, ...] = (1,)
    optional: bool = True


def _t(name, datatype, dims=(1,), optional=True):
    return Tensor(name, datatype, tuple(dims), optional)


PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
INPUTS = {
    LLMAPI: [_t("text_input", "BYTES", (-1,), False), _t("streaming", "BOOL"),
             _t("sampling_param_best_of", "INT32"), _t("sampling_param_temperature", "FP32"),
             _t("sampling_param_top_k", "INT32"), _t("sampling_param_top_p", "FP32"),
             _t("sampling_param_frequency_penalty", "FP32"), _t("sampling_param_presence_penalty", "FP32"),
             _t("sampling_param_max_tokens", "INT32"), _t("sampling_param_stop", "BYTES", (-1,)),
             _t("sampling_param_seed", "UINT64"), _t("sampling_param_exclude_input_from_output", "BOOL"),
             _t("sampling_param_return_perf_metrics", "BOOL"), _t("return_finish_reason", "BOOL"),
             _t("return_stop_reason", "BOOL"), _t("return_cumulative_logprob", "BOOL"), _t("stop", "BOOL"),
             # aliases genai-perf's tensorrtllm payloads use (max_tokens, exclude_input_in_output, stream)
             _t("max_tokens", "INT32"), _t("exclude_input_in_output", "BOOL"), _t("stream", "BOOL"),
             _t("min_length", "INT32")],
    VLLM: [_t("text_input", "BYTES", (1,), False), _t("image", "BYTES", (-1,)), _t("stream", "BOOL"),
           _t("sampling_parameters", "BYTES"), _t("exclude_input_in_output", "BOOL"),
           _t("return_finish_reason", "BOOL"), _t("return_cumulative_logprob", "BOOL"),
           _t("return_logprobs", "BOOL"), _t("return_num_input_tokens", "BOOL"),
           _t("return_num_output_tokens", "BOOL")],
    ENSEMBLE: [_t("text_input", "BYTES", (1,), False), _t("max_tokens", "INT32", (1,), False),
               _t("bad_words", "BYTES", (-1,)), _t("stop_words", "BYTES", (-1,)),
               _t("exclude_input_in_output", "BOOL"), _t("end_id", "INT32"), _t("pad_id", "INT32"),
               _t("top_k", "INT32"), _t("top_p", "FP32"), _t("temperature", "FP32"),
               _t("length_penalty", "FP32"), _t("repetition_penalty", "FP32"), _t("min_tokens", "INT32"),
               _t("presence_penalty", "FP32"), _t("frequency_penalty", "FP32"), _t("seed", "UINT64"),
               _t("return_log_probs", "BOOL"), _t("return_context_logits", "BOOL"),
               _t("return_generation_logits", "BOOL"), _t("return_perf_metrics", "BOOL"),
               _t("return_num_input_tokens", "BOOL"), _t("return_num_output_tokens", "BOOL"),
               _t("beam_width", "INT32"), _t("num_return_sequences", "INT32"), _t("stream", "BOOL")],
}
OUTPUTS = {
    LLMAPI: [_t("text_output", "BYTES", (-1,)), _t("finish_reason", "BYTES", (-1,)),
             _t("stop_reason", "BYTES", (-1,)), _t("cumulative_logprob", "BYTES", (-1,))]
            + [_t(n, "BYTES", (-1,)) for n in PERF_OUTPUTS],
    VLLM: [_t("text_output", "BYTES", (-1,)), _t("finish_reason", "BYTES", (-1,)),
           _t("cumulative_logprob", "FP32", (-1,)), _t("logprobs", "BYTES", (-1,)),
           _t("num_input_tokens", "UINT32", (1,)), _t("num_output_tokens", "UINT32", (-1,))],
    ENSEMBLE: [_t("text_output", "BYTES", (-1,)), _t("cum_log_probs", "FP32", (-1,)),
               _t("output_log_probs", "FP32", (-1, -1)), _t("batch_index", "INT32"),
               _t("sequence_index", "INT32")]
              + [_t(n, "INT64") for n in PERF_OUTPUTS[:4]]
              + [_t("acceptance_rate", "FP32"), _t("total_accepted_draft_tokens", "INT32"),
                 _t("total_draft_tokens", "INT32"), _t("num_input_tokens", "INT32"),
                 _t("num_output_tokens", "INT32")],
}
CONFIG_TYPES = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64"}


def model_metadata(model: ServedModel) -> dict:
    batch = (-1,) if model.source.max_batch_size > 0 else ()

    def tensors(items):
        return [{"name": t.name, "datatype": t.datatype, "shape": list(batch + t.dims)} for t in items]

    return {"name": model.name, "versions": [model.version], "platform": model.source.platform,
            "inputs": tensors(INPUTS[model.kind]), "outputs": tensors(OUTPUTS[model.kind])}


def model_config(model: ServedModel) -> dict:
    source, engine = model.source, model.engine
    config = source.config
    parameters = {"speculative_method": engine.method_name, "max_draft_len": str(engine.max_draft_len),
                  "model": str(config.model.source), "max_model_len": str(engine.max_model_len)}
    if config.speculative.model:
        parameters["speculative_model"] = str(config.speculative.model)
    return {
        "name": model.name, "platform": source.platform, "backend": source.backend,
        "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": source.max_batch_size,
        "input": [{"name": t.name, "data_type": CONFIG_TYPES[t.datatype], "format": "FORMAT_NONE",
                   "dims": list(t.dims), "is_shape_tensor": False, "allow_ragged_batch": False,
                   "optional": t.optional} for t in INPUTS[model.kind]],
        "output": [{"name": t.name, "data_type": CONFIG_TYPES[t.datatype], "dims": list(t.dims),
                    "label_filename": "", "is_shape_tensor": False} for t in OUTPUTS[model.kind]],
        "instance_group": [{"name": f"{model.name}_0", "kind": "KIND_CPU", "count": 1, "gpus": []}],
        "dynamic_batching": {"default_queue_policy": {"max_queue_size": str(source.max_queue_size)}},
        "model_transaction_policy": {"decoupled": source.decoupled},
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }


# ------------------------------------------------------------------------------------------------------------------
# request parsing: the three styles share one table of input names


def _unwrap(key: str, value):
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise InputError(f"input '{key}' must hold a single element, got {len(value)}")
    if isinstance(value, dict):
        raise InputError(f"parameter '{key}' has invalid type: an object is not allowed")
    return value


def as_int(key: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _unwrap(key, value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InputError(f"'{key}' must be an integer, got {value!r}") from None
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
    value = _unwrap(key, value)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise InputError(f"'{key}' must be a number, got {value!r}") from None
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
}
RETURN_FLAGS = {"return_finish_reason", "return_stop_reason", "return_num_input_tokens", "return_num_output_tokens"}
UNSUPPORTED_FLAGS = {"return_cumulative_logprob", "return_log_probs", "return_logprobs", "return_context_logits",
                     "return_generation_logits", "return_kv_cache_reuse_stats"}
MUST_BE_ONE = {"sampling_param_best_of", "best_of", "n", "num_return_sequences", "beam_width"}
NEUTRAL_FLOATS = {"sampling_param_frequency_penalty": 0.0, "frequency_penalty": 0.0,
                  "sampling_param_presence_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
                  "repetition_penalty": 1.0, "length_penalty": 1.0}
IGNORED = {"pad_id", "model", "spaces_between_special_tokens", "detokenize", "priority", "timeout",
           "binary_data_output", "triton_enable_empty_final_response", "sequence_id", "sequence_start",
           "sequence_end", "cancellation_check_period_ms", "lora_name"}
UNSUPPORTED_INPUTS = {"image", "image_url", "lora_id", "lora_path", "lora_ckpt_source", "lora_task_id",
                      "lora_weights", "lora_config", "embedding_request", "prompt_embedding_table",
                      "prompt_table_extra_id", "prompt_vocab_size", "guided_decoding_guide_type",
                      "guided_decoding_guide", "decoder_text_input", "embedding_bias_words",
                      "embedding_bias_weights", "structured_outputs", "guided_decoding",
                      "sampling_param_logits_post_processor_name", "logit_bias", "allowed_token_ids"}
DEFAULT_MAX_TOKENS = {LLMAPI: 32, VLLM: 16, ENSEMBLE: None}  # LLM-API SamplingParams / vLLM defaults
DEFAULT_TEMPERATURE = {LLMAPI: 0.0, VLLM: 1.0, ENSEMBLE: 0.0}  # TRT-LLM samples greedily unless told


@dataclass
class GenerateRequest:
    prompt: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False  # several responses (streaming / stream = true)
    cumulative: bool = False  # llmapi `streaming`: each response repeats the whole text so far
    exclude_input: bool | None = None
    returns: set[str] = field(default_factory=set)
    cancel: bool = False
    request_id: str = ""


def flatten_body(body: dict) -> dict:
    """Triton's exact mapping: top-level keys and the keys of the nested "parameters" object, one namespace."""
    values = {}
    params = body.get("parameters", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InputError("'parameters' must be a JSON object")
    values.update(params)
    values.update({k: v for k, v in body.items() if k not in ("parameters", "id")})
    return values


def parse_generate(values: dict, model: ServedModel, request_id: str = "") -> GenerateRequest:
    """The flattened inputs of a generate / infer request -> GenerateRequest; InputError names the bad key."""
    kind, name = model.kind, model.name
    req = GenerateRequest(request_id=request_id)
    settings: dict = {}
    stop: list[str] = []
    stop_ids: list[int] = []
    flags: dict[str, bool] = {}
    extra = values.get("sampling_parameters")
    if extra is not None:  # vLLM: a JSON-encoded dict of SamplingParams fields
        try:
            extra = json.loads(as_str("sampling_parameters", extra))
        except ValueError as exc:
            raise InputError(f"'sampling_parameters' is not valid JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise InputError("'sampling_parameters' must be a JSON object")
        values = {**extra, **{k: v for k, v in values.items() if k != "sampling_parameters"}}
    for key, value in values.items():
        target = ALIASES.get(key)
        if key == "text_input":
            if isinstance(value, list) and len(value) > 1:
                raise InputError("text_input must hold a single prompt (batched prompts are not supported)")
            req.prompt = as_str(key, value)
        elif target == "max_tokens":
            settings["max_tokens"] = as_int(key, value)
        elif target == "temperature":
            settings["temperature"] = as_float(key, value)
        elif target == "top_p":
            settings["top_p"] = as_float(key, value)
        elif target == "top_k":
            settings["top_k"] = as_int(key, value)
        elif target == "seed":
            settings["seed"] = as_int(key, value, 0, UINT64_MAX)
        elif target == "stop":
            stop += as_str_list(key, value)
        elif key == "stop":  # llmapi: BOOL = cancel the request with this id; vLLM: stop strings
            if isinstance(_first(value), bool):
                req.cancel = as_bool(key, value)
            else:
                stop += as_str_list(key, value)
        elif key == "stop_token_ids":
            stop_ids += as_int_list(key, value)
        elif key == "end_id":
            stop_ids.append(as_int(key, value, 0))
        elif key == "ignore_eos":
            settings["ignore_eos"] = as_bool(key, value)
        elif target == "exclude":
            flags["exclude"] = as_bool(key, value)
        elif target == "return_perf_metrics":
            if as_bool(key, value):
                req.returns.add("perf_metrics")
        elif target == "min_tokens":
            settings["min_tokens"] = as_int(key, value, 0)
        elif key in ("streaming", "stream"):
            flags[key] = as_bool(key, value)
        elif key in RETURN_FLAGS:
            if as_bool(key, value):
                req.returns.add(key.removeprefix("return_"))
        elif key in UNSUPPORTED_FLAGS:
            if as_bool(key, value):
                raise InputError(f"'{key}' is not supported by specserve (no log-probabilities or logits)")
        elif key in MUST_BE_ONE:
            if as_int(key, value) != 1:
                raise InputError(f"'{key}' must be 1: specserve returns one sequence per request")
        elif key in NEUTRAL_FLOATS:
            if as_float(key, value) != NEUTRAL_FLOATS[key]:
                raise InputError(f"'{key}' is not supported by specserve (only {NEUTRAL_FLOATS[key]})")
        elif key == "bad_words":
            if as_str_list(key, value):
                raise InputError("'bad_words' is not supported by specserve")
        elif key == "skip_special_tokens":
            if not as_bool(key, value):
                raise InputError("'skip_special_tokens' = false is not supported by specserve")
        elif key == "include_stop_str_in_output":
            if as_bool(key, value):
                raise InputError("'include_stop_str_in_output' = true is not supported by specserve")
        elif key in ("logprobs", "prompt_logprobs"):
            if value not in (None, 0, False):
                raise InputError(f"'{key}' is not supported by specserve")
        elif key in IGNORED:
            continue
        elif key in UNSUPPORTED_INPUTS:
            if value not in (None, "", [], [""]):
                raise InputError(f"input '{key}' is not supported by specserve")
        else:
            raise InputError(f"unexpected inference input '{key}' for model '{name}'")

    if "text_input" not in values and not req.cancel:
        raise InputError(f"expected input 'text_input' for model '{name}': missing required input(s) "
                         "['text_input']")
    if kind == ENSEMBLE and "max_tokens" not in settings and not req.cancel:
        raise InputError(f"expected input 'max_tokens' for model '{name}': missing required input(s) "
                         "['max_tokens']")

    # streaming: llmapi's `streaming` repeats the cumulative text (the LLM API's quirk); `stream` sends deltas
    req.stream = bool(flags.get("streaming") or flags.get("stream"))
    req.cumulative = bool(flags.get("streaming")) and kind == LLMAPI
    req.exclude_input = flags.get("exclude")
    if req.stream and not model.source.decoupled:
        raise InputError(STREAMING_NOT_DECOUPLED)
    if kind == VLLM and req.stream and req.exclude_input is False:
        raise InputError("When streaming, `exclude_input_in_output` = False is not allowed.")

    max_tokens = settings.get("max_tokens", DEFAULT_MAX_TOKENS[kind])
    min_tokens = settings.pop("min_tokens", 0)
    if min_tokens and max_tokens is not None and min_tokens >= max_tokens:
        settings["ignore_eos"] = True  # exactly max_tokens tokens (genai-perf's deterministic output length)
    elif min_tokens > 0:
        raise InputError("min_tokens below max_tokens is not supported by specserve (min_tokens = max_tokens is)")
    params = SamplingParams(max_tokens=max_tokens, temperature=settings.get("temperature", DEFAULT_TEMPERATURE[kind]),
                            top_p=settings.get("top_p", 1.0), top_k=settings.get("top_k", 0),
                            seed=settings.get("seed"), stop=stop, stop_token_ids=stop_ids,
                            ignore_eos=settings.get("ignore_eos", False))
    try:
        params.validate()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    req.params = params
    return req


def _first(value):
    while isinstance(value, list) and value:
        value = value[0]
    return value


# ------------------------------------------------------------------------------------------------------------------
# responses


def _echo(model: ServedModel, req: GenerateRequest) -> bool:
    """Whether text_output starts with the prompt: non-streaming responses of all three (unless excluded), and
    llmapi's cumulative streaming."""
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


def build_outputs(model: ServedModel, req: GenerateRequest, text: str, new_tokens: int, prompt_tokens: int,
                  result=None, timing=None) -> dict:
    """One response's outputs and response parameters, {name: value} (values are JSON scalars)."""
    kind = model.kind
    out: dict = {"text_output": text}
    if kind == ENSEMBLE:  # response parameters the ensemble scheduler adds
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
        m = result.metrics
        perf = {"arrival_time_ns": timing.arrival_ns, "first_scheduled_time_ns": timing.started_ns,
                "first_token_time_ns": timing.first_token_ns, "last_token_time_ns": timing.last_token_ns,
                "acceptance_rate": float(m.acceptance_rate),
                "total_accepted_draft_tokens": m.total_accepted_draft_tokens,
                "total_draft_tokens": m.total_draft_tokens,
                "acceptance_length": float(m.acceptance_length)}  # specserve extra: tokens per target forward
        if kind == LLMAPI:  # the LLM-API model sends these as BYTES tensors: JSON strings
            perf = {k: str(v) for k, v in perf.items()}
        out.update(perf)
    return out


def _error(message: str, status: int = 400) -> Response:
    return json_response({"error": message}, status)


def _status(exc: BaseException) -> int:
    if isinstance(exc, (InputError, RequestError, RepositoryError, RunnerError)):
        return exc.status if hasattr(exc, "status") else 400
    return 500


def _message(model: ServedModel, exc: BaseException) -> str:
    if isinstance(exc, (InputError, RequestError, RunnerError)):
        return str(exc)
    prefix = {LLMAPI: "Error generating request: ", VLLM: "Error generating stream: ", ENSEMBLE: ""}[model.kind]
    return f"{prefix}{exc}"


async def read_json(request: Request) -> dict:
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise InputError(f"unsupported Content-Encoding '{encoding}'")
    if not body.strip():
        return {}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"failed to parse the request JSON buffer: invalid UTF-8 at byte {exc.start}") from None
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise InputError(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(payload, dict):
        raise InputError("failed to parse the request JSON buffer: the request must be a JSON object")
    return payload


def _resolve(request: Request) -> ServedModel:
    ctx: ServerContext = request.app.state.ctx
    params = request.path_params
    return ctx.repository.get(params["model"], params.get("version"))


def _request_id(body: dict) -> str:
    rid = body.get("id", "")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise InputError("'id' must be a string")
    return str(rid)


def _cancel_by_id(ctx: ServerContext, req: GenerateRequest) -> Response:
    """llmapi `stop: true`: cancel the in-flight requests that carry this request's id."""
    if not req.request_id:
        return _error("A request id must be provided for request cancellation")
    for handle in list(ctx.inflight.get(req.request_id, ())):
        handle.cancel()
    return _error("Request cancelled by client")


# ------------------------------------------------------------------------------------------------------------------
# generate / generate_stream


async def _prepare(request: Request, model: ServedModel):
    body = await read_json(request)
    rid = _request_id(body)
    return parse_generate(flatten_body(body), model, rid)


def _head(model: ServedModel, req: GenerateRequest) -> dict:
    head = {"model_name": model.name, "model_version": model.version}
    if req.request_id:
        head["id"] = req.request_id
    return head


def _handle_errors(request: Request, model: ServedModel | None, exc: BaseException) -> Response:
    if isinstance(exc, InputError) and model is not None:  # reached the model, refused before it ran
        request.app.state.ctx.metrics.record_failure(model.name, model.version, "OTHER")
    if isinstance(exc, ClientDisconnected):
        return Response(status_code=499)
    if isinstance(exc, (InputError, RepositoryError, RequestError, RunnerError)):
        return _error(str(exc), _status(exc))
    return _error(_message(model, exc) if model else str(exc), 500)


async def generate(request: Request) -> Response:
    model = None
    try:
        ctx: ServerContext = request.app.state.ctx
        model = _resolve(request)
        req = await _prepare(request, model)
        if req.cancel:
            return _cancel_by_id(ctx, req)
        if req.stream:
            raise InputError(MULTI_RESPONSE_ERROR)
        payload = await with_disconnect(request, _complete(ctx, model, req))
        return json_response(payload)
    except Exception as exc:  # noqa: BLE001 - the server stays up
        return _handle_errors(request, model, exc)


async def run_to_end(stream: RequestStream) -> tuple[str, int]:
    """Start a request and collect it: (text, output tokens); stream.result / .timing are set."""
    texts, tokens = [], 0
    try:
        await stream.start()
        async for event in stream:
            texts.append(event.text)
            tokens += len(event.token_ids)
    finally:
        await stream.aclose()
    return "".join(texts), tokens


async def _complete(ctx: ServerContext, model: ServedModel, req: GenerateRequest) -> dict:
    """Run a request to the end: the single response's outputs."""
    stream = RequestStream(ctx, model, req.prompt, req.params, req.request_id)
    text, tokens = await run_to_end(stream)
    text = (req.prompt if _echo(model, req) else "") + text
    return {**_head(model, req),
            **build_outputs(model, req, text, tokens, stream.prompt_tokens, stream.result, stream.timing)}


async def generate_stream(request: Request) -> Response:
    model = None
    try:
        ctx: ServerContext = request.app.state.ctx
        model = _resolve(request)
        req = await _prepare(request, model)
        if req.cancel:
            return _cancel_by_id(ctx, req)
        stream = RequestStream(ctx, model, req.prompt, req.params, req.request_id)
        try:
            await stream.start()
            first = await with_disconnect(request, stream.__anext__())
        except BaseException:
            await stream.aclose()
            raise
        return EventStream(_stream_body(model, req, stream, first))
    except StopAsyncIteration:
        return _error(_message(model, RuntimeError("the model produced no response")), 500)
    except Exception as exc:  # noqa: BLE001
        return _handle_errors(request, model, exc)


async def _stream_body(model: ServedModel, req: GenerateRequest, stream: RequestStream, first):
    """SSE events: one per engine step with text (deltas, or the cumulative text for llmapi `streaming`), or a
    single event with the whole response when the request does not stream. Errors: `data: {"error": ...}`."""
    echo = req.prompt if _echo(model, req) else ""
    texts: list[str] = []
    tokens = 0
    event = first
    try:
        while True:
            texts.append(event.text)
            tokens += len(event.token_ids)
            result = event.result
            if req.stream and (event.text or result is not None):
                text = echo + "".join(texts) if req.cumulative else event.text
                new = tokens if req.cumulative else len(event.token_ids)
                yield sse({**_head(model, req), **build_outputs(model, req, text, new, stream.prompt_tokens,
                                                                result, stream.timing)})
            if result is not None:
                break
            event = await stream.__anext__()
        if not req.stream:
            yield sse({**_head(model, req), **build_outputs(model, req, echo + "".join(texts), tokens,
                                                            stream.prompt_tokens, result, stream.timing)})
    except StopAsyncIteration:
        pass
    except Exception as exc:  # noqa: BLE001 - mid-stream errors go in-band
        yield sse({"error": _message(model, exc)})
    finally:
        await stream.aclose()


# ------------------------------------------------------------------------------------------------------------------
# infer (KServe v2, JSON and the binary tensor extension)

NUMERIC = {"BOOL": "?", "INT8": "b", "UINT8": "B", "INT16": "h", "UINT16": "H", "INT32": "i", "UINT32": "I",
           "INT64": "q", "UINT64": "Q", "FP32": "f", "FP64": "d"}


def _decode_binary(name: str, datatype: str, raw: bytes) -> list:
    if datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise InputError(f"malformed binary data for input '{name}'")
            (length,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            chunk = raw[offset:offset + length]
            if len(chunk) != length:
                raise InputError(f"malformed binary data for input '{name}'")
            offset += length
            try:
                items.append(chunk.decode("utf-8"))
            except UnicodeDecodeError:
                raise InputError(f"input '{name}' is not valid UTF-8") from None
        return items
    code = NUMERIC.get(datatype)
    if code is None:
        raise InputError(f"unsupported datatype {datatype} for input '{name}'")
    size = struct.calcsize(code)
    if len(raw) % size:
        raise InputError(f"binary data for input '{name}' is not a whole number of {datatype} elements")
    return [v for (v,) in struct.iter_unpack("<" + code, raw)]


def _flatten(data) -> list:
    if not isinstance(data, list):
        return [data]
    out = []
    for item in data:
        out.extend(_flatten(item))
    return out


def parse_infer(body: bytes, header_length: str | None) -> tuple[dict, dict]:
    """An infer request body -> (the JSON header, {input name: list of values})."""
    if header_length is not None:
        try:
            split = int(header_length)
        except ValueError:
            raise InputError("Inference-Header-Content-Length must be an integer") from None
        if split < 0 or split > len(body):
            raise InputError("Inference-Header-Content-Length is larger than the body")
        head, binary = body[:split], body[split:]
    else:
        head, binary = body, b""
    try:
        payload = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), list):
        raise InputError("the infer request must be a JSON object with an 'inputs' array")
    values, offset = {}, 0
    for tensor in payload["inputs"]:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InputError("each input must be an object with a 'name'")
        name, datatype = tensor["name"], str(tensor.get("datatype", "BYTES")).upper()
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InputError(f"binary_data_size of input '{name}' exceeds the body")
            values[name] = _decode_binary(name, datatype, binary[offset:offset + size])
            offset += size
        elif "data" in tensor:
            values[name] = _flatten(tensor["data"])
        else:
            raise InputError(f"input '{name}' has no data")
    return payload, values


def _encode_binary(datatype: str, value) -> bytes:
    if datatype == "BYTES":
        raw = str(value).encode()
        return struct.pack("<I", len(raw)) + raw
    return struct.pack("<" + NUMERIC[datatype], value)


def _output_value(datatype: str, value):
    if datatype == "BYTES":
        return str(value)
    if datatype.startswith("FP"):
        return float(value)
    if datatype == "BOOL":
        return bool(value)
    return int(value)


async def infer(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    model = None
    try:
        model = _resolve(request)
        body = await request.body()
        payload, values = parse_infer(body, request.headers.get("inference-header-content-length"))
        rid = _request_id(payload)
        params = payload.get("parameters") or {}
        if not isinstance(params, dict):
            raise InputError("'parameters' must be a JSON object")
        binary_default = bool(params.get("binary_data_output", False))
        values = {**{k: v for k, v in params.items()}, **values}
        req = parse_generate(values, model, rid)
        if req.cancel:
            return _cancel_by_id(ctx, req)
        if req.stream:
            raise InputError("HTTP end point doesn't support streaming responses; use generate_stream")
        outputs = await with_disconnect(request, _complete(ctx, model, req))
    except Exception as exc:  # noqa: BLE001
        return _handle_errors(request, model, exc)

    declared = {t.name: t for t in OUTPUTS[model.kind]}
    requested = payload.get("outputs")
    if requested is not None:
        if not isinstance(requested, list):
            return _error("'outputs' must be an array")
        wanted = {}
        for item in requested:
            name = item.get("name") if isinstance(item, dict) else None
            if name not in declared:
                return _error(f"unexpected inference output '{name}' for model '{model.name}'")
            wanted[name] = bool((item.get("parameters") or {}).get("binary_data", binary_default))
    else:
        wanted = {name: binary_default for name in outputs if name in declared}
    shape = [1, 1] if model.source.max_batch_size > 0 else [1]
    tensors, blobs, response_params = [], [], {}
    for name in ("sequence_end", "sequence_id", "sequence_start"):
        if name in outputs:
            response_params[name] = outputs[name]
    for name, binary in wanted.items():
        if name not in outputs:
            continue
        datatype = declared[name].datatype
        value = _output_value(datatype, outputs[name])
        tensor = {"name": name, "datatype": datatype, "shape": shape}
        if binary:
            blob = _encode_binary(datatype, value)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = [value]
        tensors.append(tensor)
    response = {"model_name": model.name, "model_version": model.version, "outputs": tensors}
    if rid:
        response["id"] = rid
    if response_params:
        response["parameters"] = response_params
    head = json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


# ------------------------------------------------------------------------------------------------------------------
# health, metadata, config, statistics, repository


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(status_code=200 if ctx.ready else 400)


async def server_metadata(request: Request) -> Response:
    return json_response({"name": SERVER_NAME, "version": server_version(), "extensions": EXTENSIONS})


def server_version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


async def metadata(request: Request) -> Response:
    try:
        return json_response(model_metadata(_resolve(request)))
    except RepositoryError as exc:
        return _error(str(exc), exc.status)


async def model_ready(request: Request) -> Response:
    try:
        _resolve(request)
    except RepositoryError:
        return _error("Model version not ready", 400)
    return Response(status_code=200)


async def config(request: Request) -> Response:
    try:
        return json_response(model_config(_resolve(request)))
    except RepositoryError as exc:
        return _error(str(exc), exc.status)


async def stats(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    name = request.path_params.get("model")
    version = request.path_params.get("version")
    if name is None:
        models = ctx.repository.ready_models()
    else:
        try:
            models = [ctx.repository.get(name, version)]
        except RepositoryError as exc:
            return _error(str(exc), exc.status)
    return json_response({"model_stats": [ctx.metrics.model_stats(m.name, m.version) for m in models]})


def _repository_ctx(request: Request) -> ServerContext:
    if request.path_params.get("repository"):
        raise RepositoryError("'repository_name' specification is not supported")
    return request.app.state.ctx


async def repository_index(request: Request) -> Response:
    try:
        ctx = _repository_ctx(request)
        body = await read_json(request)
        ready_only = as_bool("ready", body.get("ready", False))
    except RepositoryError as exc:
        return _error(str(exc), 501)
    except InputError as exc:
        return _error(str(exc), 400)
    return json_response(ctx.repository.index(ready_only))


async def repository_load(request: Request) -> Response:
    try:
        ctx = _repository_ctx(request)
    except RepositoryError as exc:
        return _error(str(exc), 501)
    name = request.path_params["model"]
    try:
        body = await read_json(request)
        parameters = body.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InputError("'parameters' must be a JSON object")
        overrides = {}
        for key, value in parameters.items():
            if key == "config":
                try:
                    cfg = json.loads(value) if isinstance(value, str) else None
                except ValueError as exc:
                    raise InputError(f"failed to parse 'config': {exc}") from None
                if not isinstance(cfg, dict):
                    raise InputError("'config' must be a JSON object encoded as a string")
                if "max_batch_size" in cfg:
                    overrides["max_batch_size"] = as_int("max_batch_size", cfg["max_batch_size"], 0)
                policy = cfg.get("model_transaction_policy") or {}
                if isinstance(policy, dict) and "decoupled" in policy:
                    overrides["decoupled"] = as_bool("decoupled", policy["decoupled"])
            elif key.startswith("file:"):
                raise InputError("loading model files through the request ('file:' parameters) is not supported")
        await asyncio.to_thread(ctx.repository.load, name, overrides or None)
    except (InputError, RepositoryError) as exc:
        return _error(str(exc), 400)
    return Response(status_code=200)


async def repository_unload(request: Request) -> Response:
    try:
        ctx = _repository_ctx(request)
    except RepositoryError as exc:
        return _error(str(exc), 501)
    try:
        await read_json(request)
        ctx.repository.unload(request.path_params["model"])
    except (InputError, RepositoryError) as exc:
        return _error(str(exc), 400)
    return Response(status_code=200)


_MODEL = "/v2/models/{model:str}"
_VERSION = "/v2/models/{model:str}/versions/{version:int_str}"


def routes() -> list[Route]:
    out = [
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/models/stats", stats, methods=["GET"]),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model:str}/load", repository_load, methods=["POST"]),
        Route("/v2/repository/models/{model:str}/unload", repository_unload, methods=["POST"]),
        Route("/v2/repository/{repository:str}/index", repository_index, methods=["POST"]),
        Route("/v2/repository/{repository:str}/models/{model:str}/load", repository_load, methods=["POST"]),
        Route("/v2/repository/{repository:str}/models/{model:str}/unload", repository_unload, methods=["POST"]),
    ]
    for base in (_MODEL, _VERSION):
        out += [
            Route(base, metadata, methods=["GET"]),
            Route(base + "/ready", model_ready, methods=["GET"]),
            Route(base + "/config", config, methods=["GET"]),
            Route(base + "/stats", stats, methods=["GET"]),
            Route(base + "/infer", infer, methods=["POST"]),
            Route(base + "/generate", generate, methods=["POST"]),
            Route(base + "/generate_stream", generate_stream, methods=["POST"]),
        ]
    return out
