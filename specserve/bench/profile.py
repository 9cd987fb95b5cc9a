"""`specserve profile`: a genai-perf-compatible LLM profiler over HTTP.

It sends the prompts of a genai-perf input file (`{"text": ...}` lines) to a running server -- Triton `generate` /
`generate_stream` (service kind triton, TRT-LLM or vLLM request style) or OpenAI `/v1/completions` /
`/v1/chat/completions` (service kind openai) -- at a fixed concurrency (closed loop) or request rate (open loop),
and computes genai-perf's LLM metrics from the client-side timestamps exactly as genai-perf does
(`genai_perf/profile_data_parser/llm_profile_data_parser.py`, `metrics/statistics.py`):

- request_latency = last response - request start; time_to_first_token = first response - request start;
  time_to_second_token = second response - first response
- output_sequence_length = tokens of the concatenated response texts, input_sequence_length = tokens of the prompt,
  both counted with the client-side tokenizer (no special tokens)
- inter_token_latency = (request_latency - ttft) / (OSL - 1) (more than one response and OSL > 1);
  output_token_throughput_per_user = 1 / ITL
- output_token_throughput = sum(OSL) / benchmark duration, request_throughput = requests / benchmark duration,
  benchmark duration = last response of any request - first request start
- responses without text are dropped before timing (the role chunk, the finish chunk, `[DONE]`); a request
  without any text is left out of the per-request statistics but counted in request_throughput
- statistics: avg, min, max, std, p1 ... p99 (numpy, linear interpolation); times in ms

Exports (into the artifact directory): the profile export file in perf_analyzer's schema (`experiments[].requests[]`
with `timestamp`, `request_inputs`, `response_timestamps`, `response_outputs`) plus a `specserve` block per request
(input hash, output text, token counts, server-reported perf metrics, error) and for the run (inputs hash, summary,
failed requests); `<stem>_genai_perf.json` and `<stem>_genai_perf.csv` in genai-perf's layout.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx
import numpy as np

from specserve.bench.jsonl import read_jsonl

PROFILER_VERSION = "specserve-profile 1"
SERVICE_KINDS = ("triton", "openai")
BACKENDS = ("tensorrtllm", "vllm")
ENDPOINT_TYPES = ("kserve", "generate", "completions", "chat")
DISTRIBUTIONS = ("constant", "poisson")
DEFAULT_TENSORRTLLM_MAX_TOKENS = 256  # genai-perf sends this when --output-tokens-mean is not given
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
TIME_METRICS = ("time_to_first_token", "time_to_second_token", "request_latency", "inter_token_latency")
# genai-perf's order: LLMMetrics.request_metrics and system_metrics (console / CSV rows)
REQUEST_METRICS = [("time_to_first_token", "ms"), ("time_to_second_token", "ms"), ("request_latency", "ms"),
                   ("inter_token_latency", "ms"), ("output_token_throughput_per_user", "tokens/sec/user"),
                   ("output_sequence_length", "tokens"), ("input_sequence_length", "tokens")]
SYSTEM_METRICS = [("output_token_throughput", "tokens/sec"), ("request_throughput", "per sec"),
                  ("request_count", "count")]
STREAMING_ONLY = {"time_to_first_token", "time_to_second_token", "inter_token_latency",
                  "output_token_throughput_per_user"}
STAT_UNITS = {"request_throughput": "requests/sec", "request_count": "count", "output_token_throughput": "tokens/sec"}
PERF_KEYS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "acceptance_length",
             "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
TEMPERATURE_KEYS = {"temperature", "sampling_param_temperature"}


class ProfileError(Exception):
    """A problem the user can fix (bad flag, input file, server, model): printed without a traceback."""


# ------------------------------------------------------------------------------------------------------------------
# configuration


@dataclass
class ProfileConfig:
    model: str
    input_file: Path
    service_kind: str = "triton"
    backend: str = "tensorrtllm"
    endpoint_type: str | None = None
    endpoint: str | None = None
    streaming: bool = False
    tokenizer: str | None = None
    url: str = "localhost:8000"
    concurrency: int | None = None
    request_rate: float | None = None
    request_distribution: str = "constant"
    request_count: int = 10
    warmup_request_count: int = 2
    output_tokens_mean: int | None = None
    output_tokens_stddev: float = 0.0
    output_tokens_mean_deterministic: bool = False
    extra_inputs: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    profile_export_file: Path = Path("profile_export.json")
    artifact_dir: Path | None = None
    server_metrics_url: str | None = None
    random_seed: int = 0
    request_timeout: float = 600.0
    progress: bool = False

    def normalize(self) -> "ProfileConfig":
        """Fill in what genai-perf infers and check the combination; raises ProfileError."""
        if not self.model:
            raise ProfileError("give the model to profile with -m/--model")
        if self.service_kind not in SERVICE_KINDS:
            raise ProfileError(f"--service-kind must be one of {', '.join(SERVICE_KINDS)}, got {self.service_kind!r}")
        if self.backend not in BACKENDS:
            raise ProfileError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.endpoint_type is not None and self.endpoint_type not in ENDPOINT_TYPES:
            raise ProfileError(f"--endpoint-type must be one of {', '.join(ENDPOINT_TYPES)}, "
                               f"got {self.endpoint_type!r}")
        # newer genai-perf infers the service kind from the endpoint type
        if self.endpoint_type in ("completions", "chat"):
            self.service_kind = "openai"
        elif self.endpoint_type in ("kserve", "generate"):
            self.service_kind = "triton"
        if self.service_kind == "openai" and self.endpoint_type is None:
            raise ProfileError("--service-kind openai needs --endpoint-type completions or chat")
        if self.service_kind == "triton":
            self.endpoint_type = self.endpoint_type or "kserve"
        if self.concurrency is not None and self.request_rate is not None:
            raise ProfileError("--concurrency and --request-rate are mutually exclusive: give one")
        if self.request_rate is None and self.concurrency is None:
            self.concurrency = 1
        if self.concurrency is not None and self.concurrency < 1:
            raise ProfileError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise ProfileError(f"--request-rate must be > 0, got {self.request_rate}")
        if self.request_distribution not in DISTRIBUTIONS:
            raise ProfileError(f"--request-distribution must be constant or poisson, "
                               f"got {self.request_distribution!r}")
        if self.request_count < 1:
            raise ProfileError(f"--request-count must be >= 1, got {self.request_count}")
        if self.warmup_request_count < 0:
            raise ProfileError(f"--warmup-request-count must be >= 0, got {self.warmup_request_count}")
        if self.output_tokens_mean is not None and self.output_tokens_mean < 1:
            raise ProfileError(f"--output-tokens-mean must be >= 1, got {self.output_tokens_mean}")
        if self.output_tokens_stddev < 0:
            raise ProfileError(f"--output-tokens-stddev must be >= 0, got {self.output_tokens_stddev}")
        if self.output_tokens_mean_deterministic and self.output_tokens_mean is None:
            raise ProfileError("--output-tokens-mean-deterministic needs --output-tokens-mean")
        if self.request_timeout <= 0:
            raise ProfileError("--request-timeout must be > 0")
        self.base_url()  # validates --url
        self.profile_export_file = Path(self.profile_export_file)
        if self.profile_export_file.suffix != ".json":
            raise ProfileError(f"--profile-export-file must end in .json, got {self.profile_export_file}")
        return self

    def base_url(self) -> str:
        url = self.url.strip().rstrip("/")
        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProfileError(f"--url must be HOST:PORT (or http://HOST:PORT), got {self.url!r}")
        try:
            parts.port
        except ValueError:
            raise ProfileError(f"--url has a bad port: {self.url!r}") from None
        return url

    @property
    def load_mode(self) -> tuple[str, float]:
        return ("concurrency", self.concurrency) if self.request_rate is None else ("request_rate", self.request_rate)

    def artifact_paths(self) -> tuple[Path, Path]:
        """(artifact directory, profile export file). genai-perf: artifacts/<model>-<kind>-<backend or endpoint
        type>-concurrency<N>/<profile export file>; a --profile-export-file with a directory is used as is."""
        export = self.profile_export_file
        if self.artifact_dir is not None:
            if export.parent != Path("."):
                raise ProfileError("give --profile-export-file as a plain file name when --artifact-dir is given")
            directory = Path(self.artifact_dir)
        elif export.parent != Path("."):
            directory = export.parent
        else:
            flavour = self.backend if self.service_kind == "triton" else self.endpoint_type
            mode, value = self.load_mode
            level = f"concurrency{int(value)}" if mode == "concurrency" else f"request_rate{value:g}"
            directory = Path("artifacts") / f"{self.model.replace('/', '_')}-{self.service_kind}-{flavour}-{level}"
        return directory, directory / export.name

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("input_file", "profile_export_file", "artifact_dir"):
            out[key] = None if out[key] is None else str(out[key])
        out.pop("progress", None)
        return out


# ------------------------------------------------------------------------------------------------------------------
# inputs


def load_input_file(path: str | Path) -> list[str]:
    """genai-perf's file input: JSONL, one object a line with a "text" (or "text_input") string; blank lines are
    skipped. Raises ProfileError naming the line."""
    path = Path(path)
    prompts: list[str] = []
    for number, record in read_jsonl(path, ProfileError, hint='; expected one {"text": "..."} object a line'):
        if not isinstance(record, dict):
            raise ProfileError(f'{path}:{number}: expected a JSON object like {{"text": "..."}}')
        text = record.get("text", record.get("text_input"))
        if text is None and "turns" in record:
            raise ProfileError(f"{path}:{number}: this is an EAGLE / MT-bench question.jsonl line; convert the file "
                               "first: specserve convert-dataset --input_file QUESTIONS --output_file CONVERTED")
        if not isinstance(text, str) or not text:
            raise ProfileError(f"{path}:{number}: expected a non-empty string in 'text' (or 'text_input')")
        prompts.append(text)
    if not prompts:
        raise ProfileError(f"input file {path} has no prompts (it is empty)")
    return prompts


@dataclass
class PlannedRequest:
    index: int  # position in the run (warm-up requests: -1, -2, ...)
    prompt_index: int
    prompt: str
    max_tokens: int | None
    min_tokens: int | None = None

    def input_hash(self, extra_inputs: dict) -> str:
        key = {"prompt": self.prompt, "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
               "extra_inputs": extra_inputs}
        return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def sample_output_tokens(rng: random.Random, mean: int, stddev: float) -> int:
    """genai-perf's bounded normal (lower bound 1), rounded down."""
    if stddev <= 0:
        return int(mean)
    return max(1, int(rng.gauss(mean, stddev)))


def plan_requests(prompts: list[str], config: ProfileConfig) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """(warm-up requests, measured requests). Prompts are taken in file order (cycling past the end), the measured
    ones from the first prompt on, so two runs with the same file and flags send the same inputs."""
    def make(index: int, position: int, rng: random.Random) -> PlannedRequest:
        prompt_index = position % len(prompts)
        max_tokens = None
        if config.output_tokens_mean is not None:
            max_tokens = sample_output_tokens(rng, config.output_tokens_mean, config.output_tokens_stddev)
        elif config.service_kind == "triton" and config.backend == "tensorrtllm":
            max_tokens = DEFAULT_TENSORRTLLM_MAX_TOKENS
        min_tokens = max_tokens if config.output_tokens_mean_deterministic else None
        return PlannedRequest(index, prompt_index, prompts[prompt_index], max_tokens, min_tokens)

    measured_rng, warmup_rng = random.Random(config.random_seed), random.Random(config.random_seed + 1)
    warmup = [make(-(i + 1), i, warmup_rng) for i in range(config.warmup_request_count)]
    measured = [make(i, i, measured_rng) for i in range(config.request_count)]
    return warmup, measured


# ------------------------------------------------------------------------------------------------------------------
# request styles


def sampling_fields(req: "PlannedRequest", greedy: bool, names: dict | None = None, temperature=0.0) -> dict:
    """The request's planned max / min tokens and, when greedy, a zero temperature, under the style's names."""
    fields = {"max_tokens": req.max_tokens, "min_tokens": req.min_tokens,
              "temperature": temperature if greedy else None}
    names = names or {}
    return {names.get(key, key): value for key, value in fields.items() if value is not None}


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


@dataclass
class RequestRecord:
    index: int
    prompt_index: int
    input_hash: str
    prompt: str
    request_inputs: dict
    timestamp: int = 0  # ns, wall clock (perf_analyzer: request start)
    response_timestamps: list[int] = field(default_factory=list)
    response_outputs: list[dict] = field(default_factory=list)  # raw, as perf_analyzer stores them
    texts: list[str] = field(default_factory=list)  # the text (delta) of each response
    perf: dict | None = None
    error: str | None = None
    status: int | None = None

    @property
    def output_text(self) -> str:
        return "".join(self.texts)


class Clock:
    """Wall-clock nanoseconds read from the monotonic high-resolution counter."""

    def __init__(self) -> None:
        self.epoch = time.time_ns()
        self.base = time.perf_counter_ns()

    def now(self) -> int:
        return self.epoch + (time.perf_counter_ns() - self.base)


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


async def run_requests(client: httpx.AsyncClient, style: Style, records: list[RequestRecord], config: ProfileConfig,
                       clock: Clock, on_done: Callable[[RequestRecord], None] | None = None,
                       concurrency: int | None = None, rate: float | None = None) -> None:
    """Closed loop (`concurrency` workers, each sending its next request when the last one finished) or open loop
    (`rate` requests per second, constant or Poisson gaps). Once the server is unreachable the remaining requests are
    not sent."""
    gone: list[str] = []

    async def one(record: RequestRecord) -> None:
        if gone:
            record.error = f"not sent: the server became unreachable ({gone[0]})"
        else:
            try:
                await send_request(client, style, record, clock)
            except ServerGone as exc:
                gone.append(str(exc))
        if on_done:
            on_done(record)

    if rate is None:
        pending = iter(records)

        async def worker() -> None:
            for record in pending:
                await one(record)

        await asyncio.gather(*(worker() for _ in range(min(concurrency or 1, len(records)))))
        return
    rng = random.Random(config.random_seed)
    loop = asyncio.get_running_loop()
    start = loop.time()
    offset = 0.0
    tasks = []
    for record in records:
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(record)))
        offset += rng.expovariate(rate) if config.request_distribution == "poisson" else 1.0 / rate
    await asyncio.gather(*tasks)


# ------------------------------------------------------------------------------------------------------------------
# metrics (genai-perf's definitions)


def request_metrics(timestamp: int, response_timestamps: list[int], texts: list[str], input_tokens: int,
                    count_tokens: Callable[[str], int]) -> dict | None:
    """One request's metrics in ns / tokens, or None when no response carried text (genai-perf skips it)."""
    kept = [(t, x) for t, x in zip(response_timestamps, texts) if x]
    if not kept:
        return None
    times = [t for t, _ in kept]
    latency = times[-1] - timestamp
    ttft = times[0] - timestamp
    osl = count_tokens("".join(x for _, x in kept))
    out = {"request_latency": latency, "time_to_first_token": ttft, "output_sequence_length": osl,
           "input_sequence_length": input_tokens}
    if len(times) > 1:
        out["time_to_second_token"] = times[1] - times[0]
    if len(times) > 1 and osl > 1:
        itl = round((latency - ttft) / (osl - 1))
        out["inter_token_latency"] = itl
        out["output_token_throughput_per_user"] = 1 / (itl / 1e9) if itl > 0 else float("inf")
    return out


def statistics(values: list[float], unit: str, scale: float = 1.0) -> dict:
    """genai-perf's statistics: unit, avg, p1..p99, min, max, std (numpy, linear percentiles)."""
    data = np.asarray(values, dtype=np.float64) * scale
    out = {"unit": unit, "avg": float(np.mean(data))}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(data, p))
    out["min"], out["max"], out["std"] = float(np.min(data)), float(np.max(data)), float(np.std(data))
    return out


def aggregate(per_request: list[dict | None], request_count: int, first_start: int | None,
              last_response: int | None) -> dict:
    """genai-perf's stats dict: request metrics (ns -> ms) with all statistics, system metrics with `avg` only."""
    rows = [m for m in per_request if m]
    stats: dict = {}
    duration = ((last_response - first_start) / 1e9) if rows and first_start is not None else 0.0
    if duration > 0:
        stats["request_throughput"] = {"unit": "requests/sec", "avg": request_count / duration}
    if rows:
        stats["request_latency"] = statistics([m["request_latency"] for m in rows], "ms", 1e-6)
    stats["request_count"] = {"unit": "count", "avg": float(len(rows))}
    for name in ("time_to_first_token", "time_to_second_token", "inter_token_latency"):
        values = [m[name] for m in rows if name in m]
        if values and (name != "inter_token_latency" or sum(values) > 0):
            stats[name] = statistics(values, "ms", 1e-6)
    if duration > 0:
        stats["output_token_throughput"] = {"unit": "tokens/sec",
                                            "avg": sum(m["output_sequence_length"] for m in rows) / duration}
    values = [m["output_token_throughput_per_user"] for m in rows if "output_token_throughput_per_user" in m]
    if values:
        stats["output_token_throughput_per_user"] = statistics(values, "tokens/sec/user")
    for name in ("output_sequence_length", "input_sequence_length"):
        if rows:
            stats[name] = statistics([m[name] for m in rows], "tokens")
    return stats


def perf_summary(records: list[RequestRecord]) -> dict | None:
    """The server-reported speculative-decoding metrics (TRT-LLM perf metrics in the responses), pooled."""
    perfs = [r.perf for r in records if r.perf and not r.error and "total_draft_tokens" in r.perf]
    if not perfs:
        return None
    drafted = sum(p["total_draft_tokens"] for p in perfs)
    accepted = sum(p.get("total_accepted_draft_tokens", 0.0) for p in perfs)
    out = {"requests_with_perf_metrics": len(perfs), "total_draft_tokens": int(drafted),
           "total_accepted_draft_tokens": int(accepted),
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "mean_request_acceptance_rate": float(np.mean([p.get("acceptance_rate", 0.0) for p in perfs]))}
    lengths = [p["acceptance_length"] for p in perfs if "acceptance_length" in p]
    if lengths:
        out["mean_acceptance_length"] = float(np.mean(lengths))
    return out


# ------------------------------------------------------------------------------------------------------------------
# server metrics (vLLM spec-decode counters on /metrics)

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def parse_spec_counters(text: str, model: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {v: 0.0 for v in SPEC_COUNTERS.values()}
    found = False
    for family in text_string_to_metric_families(text):
        if family.name.removesuffix("_total") in SPEC_COUNTERS:
            found = True  # the server has the counters (no sample yet for a model that has not drafted: zeros)
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in SPEC_COUNTERS and sample.labels.get("model_name", model) == model:
                out[SPEC_COUNTERS[name]] += sample.value
                found = True
    return out if found else {}


async def scrape(client: httpx.AsyncClient, urls: list[str], model: str) -> tuple[str | None, dict]:
    for url in urls:
        try:
            response = await client.get(url, timeout=5.0)
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            try:
                counters = parse_spec_counters(response.text, model)
            except ValueError:
                continue
            return url, counters
    return None, {}


def spec_delta(before: dict, after: dict) -> dict | None:
    if not before or not after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    if d.get("num_drafts", 0) <= 0:
        return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "acceptance_rate": 0.0,
                "mean_acceptance_length": 1.0}
    return {"num_drafts": int(d["num_drafts"]), "num_draft_tokens": int(d["num_draft_tokens"]),
            "num_accepted_tokens": int(d["num_accepted_tokens"]),
            "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"]}


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


# ------------------------------------------------------------------------------------------------------------------
# the run


@dataclass
class ProfileResult:
    config: ProfileConfig
    records: list[RequestRecord]
    stats: dict
    per_request: list[dict | None]
    input_tokens: list[int]
    output_tokens: list[int | None]
    server_spec: dict | None
    perf: dict | None
    export_file: Path
    genai_perf_json: Path
    genai_perf_csv: Path
    style: Style
    tokenizer_name: str
    window: tuple[int, int]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error]


def run_profile(config: ProfileConfig, echo: Callable[[str], None] = lambda s: None) -> ProfileResult:
    """The whole run: inputs, pre-flight, warm-up, measurement, metrics, exports. Raises ProfileError before the
    measurement; a measurement with failed requests returns a result whose `failed` is non-empty (the exports say
    which)."""
    config.normalize()
    prompts = load_input_file(config.input_file)
    return asyncio.run(_run(config, prompts, echo))


async def _run(config: ProfileConfig, prompts: list[str], echo) -> ProfileResult:
    base = config.base_url()
    directory, export_file = config.artifact_paths()
    limits = httpx.Limits(max_connections=max(config.concurrency or 0, 64), max_keepalive_connections=64)
    timeout = httpx.Timeout(config.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits, headers=config.headers) as client:
        style, parameters = await check_server(client, config, base)
        tokenizer, tokenizer_name = await asyncio.to_thread(load_tokenizer, config.tokenizer, parameters,
                                                            config.model)
        warmup, measured = plan_requests(prompts, config)
        clock = Clock()
        if warmup:
            echo(f"warm-up: {len(warmup)} request(s)")
            records = [make_record(r, style, config) for r in warmup]
            await run_requests(client, style, records, config, clock, concurrency=config.concurrency or 1)
            bad = [r for r in records if r.error]
            if len(bad) == len(records):
                raise ProfileError(f"the warm-up request failed, so the run was not started: {bad[0].error}")
        metrics_urls = ([config.server_metrics_url] if config.server_metrics_url else
                        [f"{base}/metrics", f"{urlsplit(base).scheme}://{urlsplit(base).hostname}:8002/metrics"])
        metrics_url, before = await scrape(client, metrics_urls, config.model)
        records = [make_record(r, style, config) for r in measured]
        bar = None
        if config.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(records), desc="Profiling", unit="req", file=sys.stderr, leave=False)
        mode, value = config.load_mode
        try:
            await run_requests(client, style, records, config, clock,
                               on_done=(lambda r: bar.update(1)) if bar else None,
                               concurrency=config.concurrency, rate=config.request_rate)
        finally:
            if bar:
                bar.close()
        window = (min(r.timestamp for r in records if r.timestamp) if any(r.timestamp for r in records) else 0,
                  clock.now())
        after = (await scrape(client, [metrics_url], config.model))[1] if metrics_url else {}
    server_spec = spec_delta(before, after)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    per_request, input_tokens, output_tokens = [], [], []
    for record in records:
        input_tokens.append(count(record.prompt))
        metrics = None
        if not record.error:
            metrics = request_metrics(record.timestamp, record.response_timestamps, record.texts, input_tokens[-1],
                                      count)
        per_request.append(metrics)
        output_tokens.append(metrics["output_sequence_length"] if metrics else (0 if not record.error else None))
    ok = [r for r, m in zip(records, per_request) if m]
    first = min((r.timestamp for r in ok), default=None)
    last = max((r.response_timestamps[-1] for r in ok), default=None)
    succeeded = sum(1 for r in records if not r.error)
    stats = aggregate(per_request, succeeded, first, last)
    result = ProfileResult(config, records, stats, per_request, input_tokens, output_tokens, server_spec,
                           perf_summary(records), export_file, directory / f"{export_file.stem}_genai_perf.json",
                           directory / f"{export_file.stem}_genai_perf.csv", style, tokenizer_name, window)
    write_exports(result)
    return result


# ------------------------------------------------------------------------------------------------------------------
# exports and console


def inputs_hash(hashes: list[str]) -> str:
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def export_document(result: ProfileResult) -> dict:
    config = result.config
    mode, value = config.load_mode
    requests = []
    for record, metrics, isl, osl in zip(result.records, result.per_request, result.input_tokens,
                                         result.output_tokens):
        requests.append({
            "timestamp": record.timestamp, "request_inputs": record.request_inputs,
            "response_timestamps": record.response_timestamps, "response_outputs": record.response_outputs,
            "specserve": {"index": record.index, "prompt_index": record.prompt_index, "input_hash": record.input_hash,
                          "output_text": record.output_text, "input_tokens": isl, "output_tokens": osl,
                          "status": record.status, "error": record.error, "perf_metrics": record.perf,
                          "metrics_ns": metrics}})
    failed = [{"index": r.index, "prompt_index": r.prompt_index, "error": r.error} for r in result.failed]
    return {
        "experiments": [{"experiment": {"mode": mode, "value": value}, "requests": requests,
                         "window_boundaries": list(result.window)}],
        "version": PROFILER_VERSION,
        "service_kind": config.service_kind,
        "endpoint": result.style.path.lstrip("/"),
        "specserve": {
            "model": config.model, "url": config.url, "service_kind": config.service_kind,
            "backend": config.backend, "endpoint_type": config.endpoint_type, "streaming": result.style.streaming,
            "tokenizer": result.tokenizer_name, "inputs_hash": inputs_hash([r.input_hash for r in result.records]),
            "request_count": len(result.records), "succeeded": len(result.records) - len(failed),
            "failed": len(failed), "failed_requests": failed, "complete": not failed,
            "stats": result.stats, "server_perf_metrics": result.perf, "server_spec_decode_metrics": result.server_spec,
            "input_config": config.to_json()},
    }


def metric_label(name: str, unit: str) -> str:
    return f"{name.replace('_', ' ').title()} ({unit})"


def _fmt(value) -> str:
    return f"{value:,.2f}" if isinstance(value, (int, float)) else str(value)


def _fetch(stats: dict, name: str, stat: str) -> str:
    value = (stats.get(name) or {}).get(stat)
    return "N/A" if value is None else _fmt(value)


def write_exports(result: ProfileResult) -> None:
    config = result.config
    directory = result.export_file.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        result.export_file.write_text(json.dumps(export_document(result), indent=2, ensure_ascii=False))
        genai = dict(result.stats)
        genai["input_config"] = config.to_json()
        result.genai_perf_json.write_text(json.dumps(genai, indent=2))
        with open(result.genai_perf_csv, "w", newline="") as f:
            writer = csv.writer(f)
            header = ["Metric", "avg", "min", "max", "p99", "p95", "p90", "p75", "p50", "p25", "p10", "p5", "p1"]
            writer.writerow(header)
            for name, unit in REQUEST_METRICS:
                if name in STREAMING_ONLY and not result.style.streaming:
                    continue
                writer.writerow([metric_label(name, unit)] + [_fetch(result.stats, name, s) for s in header[1:]])
            writer.writerow([])
            writer.writerow(["Metric", "Value"])
            for name, unit in SYSTEM_METRICS:
                writer.writerow([metric_label(name, unit), _fetch(result.stats, name, "avg")])
    except OSError as exc:
        raise ProfileError(f"cannot write the exports into {directory}: {exc}") from None


def console_table(result: ProfileResult) -> str:
    """genai-perf's console table (columns avg, min, max, p99, p90, p75; system metrics: avg only)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="specserve profile | LLM Metrics")
    table.add_column("Statistic", justify="right", style="cyan")
    columns = ["avg", "min", "max", "p99", "p90", "p75"]
    for column in columns:
        table.add_column(column, justify="right", style="green")
    for name, unit in REQUEST_METRICS:
        if name in STREAMING_ONLY and not result.style.streaming:
            continue
        if name not in result.stats:
            continue
        table.add_row(metric_label(name, unit), *[_fetch(result.stats, name, c) for c in columns])
    for name, unit in SYSTEM_METRICS:
        table.add_row(metric_label(name, unit), _fetch(result.stats, name, "avg"), *["N/A"] * 5)
    console = Console(width=120, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    lines = [capture.get().rstrip("\n")]
    spec = result.perf
    if spec:
        line = (f"Speculative decoding (server-reported, {spec['requests_with_perf_metrics']} responses): "
                f"acceptance rate {spec['acceptance_rate']:.3f} ({spec['total_accepted_draft_tokens']}/"
                f"{spec['total_draft_tokens']} draft tokens)")
        if "mean_acceptance_length" in spec:
            line += f", {spec['mean_acceptance_length']:.2f} tokens per target forward"
        lines.append(line)
    if result.server_spec and result.server_spec["num_drafts"]:
        s = result.server_spec
        lines.append(f"Server /metrics (vllm:spec_decode_*): {s['num_drafts']} drafts, acceptance rate "
                     f"{s['acceptance_rate']:.3f}, mean acceptance length {s['mean_acceptance_length']:.2f} "
                     "(1 + accepted / drafts)")
    return "\n".join(lines)
