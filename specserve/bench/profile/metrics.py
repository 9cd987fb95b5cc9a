"""`specserve profile`'s metrics: one request's record and genai-perf's metrics over it, the statistics and the
run's stats dict (the definitions are in the package docstring), the server-reported speculative-decoding
metrics and the server's vLLM spec-decode counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import numpy as np

PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
# genai-perf's order: LLMMetrics.request_metrics and system_metrics (console / CSV rows)
REQUEST_METRICS = [("time_to_first_token", "ms"), ("time_to_second_token", "ms"), ("request_latency", "ms"),
                   ("inter_token_latency", "ms"), ("output_token_throughput_per_user", "tokens/sec/user"),
                   ("output_sequence_length", "tokens"), ("input_sequence_length", "tokens")]
SYSTEM_METRICS = [("output_token_throughput", "tokens/sec"), ("request_throughput", "per sec"),
                  ("request_count", "count")]
STREAMING_ONLY = {"time_to_first_token", "time_to_second_token", "inter_token_latency",
                  "output_token_throughput_per_user"}


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
