"""`specserve profile`'s clients: the request style of each service kind (Triton `generate` / `generate_stream` in
TRT-LLM or vLLM style, OpenAI completions / chat), sending one request and reading its responses, and the
pre-flight: server, model, tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from specserve.bench.profile.config import ProfileConfig, ProfileError
from specserve.bench.profile.inputs import PlannedRequest, sampling_fields
from specserve.bench.profile.metrics import Clock, RequestRecord

PERF_KEYS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "acceptance_length",
             "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
TEMPERATURE_KEYS = {"temperature", "sampling_param_temperature"}


# ------------------------------------------------------------------------------------------------------------------
# request styles


@dataclass
class Style:
    """How to build one request and read its responses for the chosen service kind / backend / endpoint type."""

    path: str
    kind: str  # "triton" or "openai"
    endpoint_type: str
    backend: str
    streaming: bool
    names: dict = field(default_factory=dict)  # triton: logical name -> the model's input name
    cumulative: bool = False  # llmapi `streaming`: each response repeats the whole text so far

    def payload(self, req: PlannedRequest, model: str, extra: dict) -> dict:
        greedy = not (TEMPERATURE_KEYS & set(extra))
        if self.kind == "openai":
            body: dict = {"model": model}
            if self.endpoint_type == "chat":
                body["messages"] = [{"role": "user", "content": req.prompt}]
            else:
                body["prompt"] = req.prompt
            body.update(sampling_fields(req, greedy))
            if self.streaming:
                body["stream"] = True
            body.update(extra)
            return body
        n = self.names
        body = {"text_input": req.prompt}
        if self.backend == "vllm":
            params = sampling_fields(req, greedy, temperature=0)
            if self.streaming:
                body[n["stream"]] = True
            if n.get("exclude"):
                body[n["exclude"]] = True
            if n.get("perf"):
                body[n["perf"]] = True
            body["parameters"] = params
        else:
            body.update(sampling_fields(req, greedy, n))
            if n.get("exclude"):
                body[n["exclude"]] = True
            if n.get("perf"):
                body[n["perf"]] = True
            if self.streaming:
                body[n["stream"]] = True
        body.update(extra)
        return body

    def text_of(self, data: dict) -> str:
        """The text of one parsed (JSON) response."""
        if self.kind == "triton":
            value = data.get("text_output", "")
            if isinstance(value, list):
                value = "".join(str(v) for v in value)
            return value if isinstance(value, str) else str(value)
        choices = data.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        if "message" in choice:
            return (choice.get("message") or {}).get("content") or ""
        if "delta" in choice:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""


def triton_style(config: ProfileConfig, inputs: set[str] | None, decoupled: bool | None) -> Style:
    """Pick the model's own input names (LLM-API `sampling_param_*`, ensemble / vLLM names) from its metadata."""
    def pick(*candidates: str) -> str | None:
        if inputs is None:
            return candidates[0]
        return next((c for c in candidates if c in inputs), None)

    streaming = config.streaming
    if streaming and decoupled is False:
        raise ProfileError(f"model '{config.model}' is not decoupled, so it cannot stream: drop --streaming or "
                           "serve it with triton_config.decoupled: True")
    if config.backend == "vllm":
        names = {"stream": pick("stream"), "exclude": pick("exclude_input_in_output"),
                 "perf": pick("return_perf_metrics") if inputs is not None else None}
    else:
        names = {"max_tokens": pick("sampling_param_max_tokens", "max_tokens"),
                 "min_tokens": pick("min_length", "min_tokens"),
                 "temperature": pick("sampling_param_temperature", "temperature"),
                 "exclude": pick("sampling_param_exclude_input_from_output", "exclude_input_in_output"),
                 "perf": pick("sampling_param_return_perf_metrics", "return_perf_metrics"),
                 "stream": pick("stream", "streaming")}
        if names["max_tokens"] is None:
            raise ProfileError(f"model '{config.model}' has no max_tokens input (sampling_param_max_tokens or "
                               "max_tokens): is it a TRT-LLM model? try --backend vllm")
        if config.output_tokens_mean_deterministic and names["min_tokens"] is None:
            raise ProfileError(f"model '{config.model}' has no min_length / min_tokens input: "
                               "--output-tokens-mean-deterministic is not possible")
        if names["temperature"] is None:
            names["temperature"] = "temperature"
    if streaming and names.get("stream") is None:
        raise ProfileError(f"model '{config.model}' has no stream input: drop --streaming")
    path = f"/v2/models/{config.model}/generate_stream" if streaming else f"/v2/models/{config.model}/generate"
    return Style(path=config.endpoint or path, kind="triton", endpoint_type=config.endpoint_type,
                 backend=config.backend, streaming=streaming, names=names,
                 cumulative=streaming and names.get("stream") == "streaming")


def openai_style(config: ProfileConfig) -> Style:
    path = "/v1/chat/completions" if config.endpoint_type == "chat" else "/v1/completions"
    return Style(path=config.endpoint or path, kind="openai", endpoint_type=config.endpoint_type,
                 backend=config.backend, streaming=config.streaming)


# ------------------------------------------------------------------------------------------------------------------
# sending


class ServerGone(Exception):
    pass


def _error_message(status: int, body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return f"HTTP {status}: {text[:300] or '(empty body)'}"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    if not error and isinstance(data, dict):
        error = data.get("message") or data.get("detail")
    return f"HTTP {status}: {error or text[:300]}"


def _perf_from(data: dict) -> dict | None:
    perf = {}
    for key in PERF_KEYS:
        if key in data:
            try:
                perf[key] = float(data[key])
            except (TypeError, ValueError):
                continue
    return perf or None


async def _iter_sse(response: httpx.Response):
    """(event name, data) per server-sent event, as the event's last line arrives."""
    data_lines: list[str] = []
    event = None
    async for line in response.aiter_lines():
        if line == "":
            if data_lines or event:
                yield event, "\n".join(data_lines)
            data_lines, event = [], None
        elif line.startswith(":"):
            continue
        elif line.startswith("data:"):
            value = line[5:]
            data_lines.append(value[1:] if value.startswith(" ") else value)
        elif line.startswith("event:"):
            event = line[6:].strip()
    if data_lines or event:
        yield event, "\n".join(data_lines)


async def send_request(client: httpx.AsyncClient, style: Style, record: RequestRecord, clock: Clock) -> None:
    """Send one request and fill the record (timestamps, texts, perf metrics, or the error)."""
    body = record.request_inputs if style.kind == "triton" else json.loads(record.request_inputs["payload"])
    previous = ""  # cumulative streams: the text so far
    record.timestamp = clock.now()
    try:
        if not style.streaming:
            response = await client.post(style.path, json=body)
            now = clock.now()
            record.status = response.status_code
            if response.status_code != 200:
                record.error = _error_message(response.status_code, response.content)
                return
            try:
                data = response.json()
            except ValueError:
                record.error = f"the response is not JSON: {response.text[:200]!r}"
                return
            record.response_timestamps.append(now)
            record.response_outputs.append(data if style.kind == "triton" else {"response": response.text})
            text = style.text_of(data)
            if style.kind == "triton" and not style.names.get("exclude") and text.startswith(record.prompt):
                text = text[len(record.prompt):]  # the model echoes the prompt and cannot be told not to
            record.texts.append(text)
            record.perf = _perf_from(data) if style.kind == "triton" else None
            return
        async with client.stream("POST", style.path, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = _error_message(response.status_code, await response.aread())
                return
            async for event, data_text in _iter_sse(response):
                now = clock.now()
                raw = f"event: {event}\ndata: {data_text}" if event else f"data: {data_text}"
                if event == "error":
                    record.error = f"error event in the stream: {data_text[:300]}"
                    return
                if data_text.strip() == "[DONE]":
                    record.response_timestamps.append(now)
                    record.response_outputs.append({"response": raw} if style.kind == "openai" else {})
                    record.texts.append("")
                    break
                try:
                    data = json.loads(data_text)
                except ValueError:
                    record.error = f"a streamed response is not JSON: {data_text[:200]!r}"
                    return
                if isinstance(data, dict) and "error" in data:
                    error = data["error"]
                    record.error = f"error in the stream: {error.get('message') if isinstance(error, dict) else error}"
                    return
                text = style.text_of(data)
                if style.cumulative:
                    full = text[len(record.prompt):] if text.startswith(record.prompt) else text
                    text, previous = (full[len(previous):] if full.startswith(previous) else full), full
                record.response_timestamps.append(now)
                record.response_outputs.append(data if style.kind == "triton" else {"response": raw})
                record.texts.append(text)
                if style.kind == "triton":
                    record.perf = _perf_from(data) or record.perf
    except httpx.ConnectError as exc:
        record.error = f"cannot connect to the server: {exc}"
        raise ServerGone(record.error) from None
    except httpx.TimeoutException:
        record.error = "timed out (--request-timeout)"
    except httpx.HTTPError as exc:  # the connection dropped mid-response, protocol errors
        record.error = f"{type(exc).__name__}: {exc or 'the connection was closed'}"


def make_record(req: PlannedRequest, style: Style, config: ProfileConfig) -> RequestRecord:
    payload = style.payload(req, config.model, config.extra_inputs)
    inputs = payload if style.kind == "triton" else {"payload": json.dumps(payload, ensure_ascii=False)}
    return RequestRecord(req.index, req.prompt_index, req.input_hash(config.extra_inputs), req.prompt, inputs)


# ------------------------------------------------------------------------------------------------------------------
# pre-flight: server, model, tokenizer


def _connect_hint(base: str) -> str:
    return (f"cannot connect to {base}: is the server running? (start it with `specserve serve`; specserve profile "
            "speaks HTTP, so give the HTTP port, 8000 by default: genai-perf's --url localhost:8001 is Triton's gRPC "
            "port)")


async def served_models(client: httpx.AsyncClient) -> list[str]:
    names: list[str] = []
    try:
        response = await client.post("/v2/repository/index", json={"ready": True})
        if response.status_code == 200:
            names = [m.get("name") for m in response.json() if isinstance(m, dict)]
    except (httpx.HTTPError, ValueError):
        pass
    if not names:
        try:
            response = await client.get("/v1/models")
            if response.status_code == 200:
                names = [m.get("id") for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    return [n for n in names if n]


async def check_server(client: httpx.AsyncClient, config: ProfileConfig, base: str) -> tuple[Style, dict]:
    """Reachability, the model, its inputs -> (style, model config parameters)."""
    model = config.model
    try:
        if config.service_kind == "openai":
            response = await client.get("/v1/models")
            if response.status_code == 200:
                ids = [m.get("id") for m in (response.json().get("data") or []) if isinstance(m, dict)]
                if ids and model not in ids:
                    raise ProfileError(f"model '{model}' is not served at {base}; served models: {', '.join(ids)}")
            style = openai_style(config)
            parameters = {}
            try:  # specserve also speaks Triton: the model's config tells where its tokenizer is
                cfg = await client.get(f"/v2/models/{model}/config")
                if cfg.status_code == 200:
                    parameters = cfg.json().get("parameters") or {}
            except (httpx.HTTPError, ValueError):
                pass
            return style, parameters
        response = await client.get(f"/v2/models/{model}")
        if response.status_code != 200:
            names = await served_models(client)
            served = f"; served models: {', '.join(names)}" if names else ""
            raise ProfileError(f"model '{model}' is not served at {base} "
                               f"({_error_message(response.status_code, response.content)}){served}")
        metadata = response.json()
        inputs = {t.get("name") for t in metadata.get("inputs", []) if isinstance(t, dict)} or None
        parameters, decoupled = {}, None
        try:
            cfg = await client.get(f"/v2/models/{model}/config")
            if cfg.status_code == 200:
                body = cfg.json()
                parameters = body.get("parameters") or {}
                policy = body.get("model_transaction_policy") or {}
                if "decoupled" in policy:
                    decoupled = bool(policy["decoupled"])
        except (httpx.HTTPError, ValueError):
            pass
        return triton_style(config, inputs, decoupled), parameters
    except httpx.ConnectError:
        raise ProfileError(_connect_hint(base)) from None
    except httpx.TimeoutException:
        raise ProfileError(f"{base} did not answer in time") from None
    except httpx.HTTPError as exc:
        raise ProfileError(f"cannot talk to {base}: {exc}") from None
    except ValueError as exc:
        raise ProfileError(f"{base} answered with something that is not JSON: {exc}") from None


def load_tokenizer(name: str | None, model_parameters: dict, model: str):
    """--tokenizer (a local directory, specserve's model names and files, or a HF name), else the tokenizer of the
    served model (its `model` config parameter, resolved by specserve's loader)."""
    import logging as _logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from specserve.models.loader import ModelLoadError, resolve_model_path

    hf_logging.set_verbosity_error()
    _logging.getLogger("transformers").setLevel(_logging.ERROR)
    candidates: list[str] = []
    if name:
        candidates.append(name)
    else:
        served = (model_parameters.get("model") or {}).get("string_value") if model_parameters else None
        candidates += [c for c in (served, model) if c]
    errors = []
    for candidate in candidates:
        try:
            _, directory = resolve_model_path(candidate)
            return AutoTokenizer.from_pretrained(str(directory)), candidate
        except ModelLoadError as exc:
            errors.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer directory
            errors.append(f"{candidate}: {exc}")
        if name:
            try:
                return AutoTokenizer.from_pretrained(candidate), candidate
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{candidate}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if not name:
        raise ProfileError("cannot find the served model's tokenizer; give --tokenizer (a tokenizer directory, a "
                           f"checkpoint directory or a specserve model name) ({'; '.join(errors)})")
    raise ProfileError(f"cannot load tokenizer {name!r}: {'; '.join(errors)}")
