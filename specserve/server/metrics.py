"""Prometheus metrics: Triton's `nv_inference_*` families and vLLM's speculative-decoding counters.

One `ServerMetrics` per app, each with its own CollectorRegistry (several servers can live in one process).
Triton prints its counters without the `_total` suffix that prometheus_client adds, so the `nv_inference_*`
counters are rendered here by hand; everything else goes through prometheus_client.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Triton core counters (HELP text from core src/metrics.cc); labels model, version (+ reason for failures)
NV_COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count": "Number of model executions performed (does not include cached requests)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds "
                                        "(includes cached requests)",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds "
                                      "(includes cached requests)",
    "nv_inference_compute_input_duration_us": "Cumulative compute input duration in microseconds "
                                              "(does not include cached requests)",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds "
                                              "(does not include cached requests)",
    "nv_inference_compute_output_duration_us": "Cumulative inference compute output duration in microseconds "
                                               "(does not include cached requests)",
}
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class ServerMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series, as vLLM
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._nv: dict[str, dict[tuple, float]] = {name: defaultdict(float) for name in NV_COUNTERS}
        r = self.registry
        self.pending = Gauge("nv_inference_pending_request_count",
                             "Instantaneous number of pending requests awaiting execution per-model.",
                             ["model", "version"], registry=r)
        self.load_duration = Gauge("nv_model_load_duration_secs", "Model load time in seconds",
                                   ["model", "version"], registry=r)
        self.first_response = Histogram("nv_inference_first_response_histogram_ms",
                                        "Duration from request to first response in milliseconds",
                                        ["model", "version"], buckets=(100, 500, 2000, 5000), registry=r)
        # vLLM names (vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py); exported with _total
        labels = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=r)
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                                  registry=r)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                        registry=r)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                           labels, registry=r)
        self.undrafted_steps = Counter(
            "specserve_spec_decode_undrafted_steps",
            "Decoding steps that verified no draft, as the speculation policy chose (nothing to look up, a draft gate "
            "closed, a draft length of 0 under load): with vllm:spec_decode_num_drafts, how often it speculated",
            labels, registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", labels + ["position"], registry=r)
        self.mean_acceptance_length = Gauge(
            "specserve_spec_decode_mean_acceptance_length",
            "Mean acceptance length over all requests so far: 1 + accepted draft tokens / drafts (vLLM's definition)",
            labels, registry=r)
        self.request_acceptance_length = Histogram(
            "specserve_request_acceptance_length",
            "Per-request acceptance length tau: tokens emitted per target forward (1.0 = plain decoding)", labels,
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0),
                              registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             labels, buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0),
                             registry=r)
        self.batch_size = Gauge("specserve_batch_size", "Requests decoded together in the model's last step "
                                "(continuous batching)", labels, registry=r)
        self.draft_len = Gauge("specserve_spec_decode_draft_len", "Draft length chosen for the last step from the "
                               "measured forward costs and the requests' acceptance (0: speculation off under "
                               "this load)", labels, registry=r)
        self.runner_source = None  # () -> [(model name, Runner)], read at scrape time
        self._drafts: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # model -> [drafts, accepted]
        self._last: dict[tuple, int] = {}  # (model, version) -> last inference, ms since the epoch

    # ---- recording ----------------------------------------------------------------------------------------------
    def register_model(self, model: str, version: str = "1", load_seconds: float | None = None) -> None:
        """Make the model's families appear (at 0) as soon as it is loaded, as Triton does."""
        with self._lock:
            for name in NV_COUNTERS:
                if name == "nv_inference_request_failure":
                    for reason in FAILURE_REASONS:
                        self._nv[name][(model, reason, version)] += 0.0
                else:
                    self._nv[name][(model, version)] += 0.0
        self.pending.labels(model, version).set(0)
        if load_seconds is not None:
            self.load_duration.labels(model, version).set(load_seconds)

    def request_started(self, model: str, version: str = "1") -> None:
        self.pending.labels(model, version).inc()

    def request_ended(self, model: str, version: str = "1") -> None:
        self.pending.labels(model, version).dec()

    def _add(self, name: str, key: tuple, value: float) -> None:
        self._nv[name][key] += value

    def record_failure(self, model: str, version: str, reason: str, timing=None) -> None:
        with self._lock:
            self._add("nv_inference_request_failure", (model, reason, version), 1)
            if timing is not None:
                self._add("nv_inference_request_duration_us", (model, version), timing.total_s * 1e6)
                self._add("nv_inference_queue_duration_us", (model, version), timing.queue_s * 1e6)

    def record_success(self, model: str, version: str, timing, result) -> None:
        """One finished request: its timing (runner.RequestTiming) and GenerationResult."""
        m = result.metrics
        with self._lock:
            key = (model, version)
            self._add("nv_inference_request_success", key, 1)
            self._last[key] = int(time.time() * 1000)
            self._add("nv_inference_count", key, 1)
            self._add("nv_inference_exec_count", key, 1)
            self._add("nv_inference_request_duration_us", key, timing.total_s * 1e6)
            self._add("nv_inference_queue_duration_us", key, timing.queue_s * 1e6)
            compute = timing.compute_s * 1e6
            prefill = min(m.time_to_first_token_s * 1e6, compute)
            self._add("nv_inference_compute_input_duration_us", key, prefill)
            self._add("nv_inference_compute_infer_duration_us", key, compute - prefill)
            self._add("nv_inference_compute_output_duration_us", key, 0.0)
            drafts = m.drafted_steps
            totals = self._drafts[model]
            totals[0] += drafts
            totals[1] += m.total_accepted_draft_tokens
            mean_tau = 1.0 + totals[1] / totals[0] if totals[0] else 1.0
        if timing.first_event is not None:
            first = timing.first_event - timing.submitted
            self.first_response.labels(model, version).observe(first * 1e3)
            self.ttft.labels(model).observe(first)
        self.e2e.labels(model).observe(timing.total_s)
        self.prompt_tokens.labels(model).inc(m.prompt_tokens)
        self.generation_tokens.labels(model).inc(m.output_tokens)
        self.request_success.labels(model, result.finish_reason).inc()
        self.num_drafts.labels(model).inc(drafts)
        self.num_draft_tokens.labels(model).inc(m.total_draft_tokens)
        self.undrafted_steps.labels(model).inc(m.undrafted_steps)
        self.num_accepted_tokens.labels(model).inc(m.total_accepted_draft_tokens)
        for position, accepted in enumerate(m.accepted_per_position):
            self.accepted_per_pos.labels(model, str(position)).inc(accepted)
        self.mean_acceptance_length.labels(model).set(mean_tau)
        if m.target_forwards:
            self.request_acceptance_length.labels(model).observe(m.acceptance_length)

    def model_stats(self, model: str, version: str) -> dict:
        """Triton's /v2/models/<m>/stats entry, from the same counters."""
        with self._lock:
            def get(name):
                return int(self._nv[name].get((model, version), 0))

            failures = sum(int(v) for (m, _, ver), v in self._nv["nv_inference_request_failure"].items()
                           if m == model and ver == version)
            success, count = get("nv_inference_request_success"), get("nv_inference_count")
            return {
                "name": model, "version": version, "last_inference": self._last.get((model, version), 0),
                "inference_count": count, "execution_count": get("nv_inference_exec_count"),
                "inference_stats": {
                    "success": {"count": success, "ns": get("nv_inference_request_duration_us") * 1000},
                    "fail": {"count": failures, "ns": 0},
                    "queue": {"count": success, "ns": get("nv_inference_queue_duration_us") * 1000},
                    "compute_input": {"count": success,
                                      "ns": get("nv_inference_compute_input_duration_us") * 1000},
                    "compute_infer": {"count": success,
                                      "ns": get("nv_inference_compute_infer_duration_us") * 1000},
                    "compute_output": {"count": success,
                                       "ns": get("nv_inference_compute_output_duration_us") * 1000},
                    "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}},
                "batch_stats": [],
            }

    # ---- exposition ---------------------------------------------------------------------------------------------
    def _render_nv(self) -> str:
        lines = []
        with self._lock:
            for name, help_text in NV_COUNTERS.items():
                series = self._nv[name]
                if not series:
                    continue
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} counter")
                for key in sorted(series):
                    if name == "nv_inference_request_failure":
                        model, reason, version = key
                        labels = f'model="{_escape(model)}",reason="{reason}",version="{_escape(version)}"'
                    else:
                        model, version = key
                        labels = f'model="{_escape(model)}",version="{_escape(version)}"'
                    lines.append(f"{name}{{{labels}}} {int(series[key])}")  # Triton prints integers
        return "\n".join(lines) + ("\n" if lines else "")

    def _refresh_batching(self) -> None:
        for name, runner in self.runner_source() if self.runner_source else []:
            stats = runner.batch_stats
            if stats is not None and stats.steps:
                self.batch_size.labels(name).set(stats.last_batch_size)
                self.draft_len.labels(name).set(stats.last_draft_len)

    def render(self) -> bytes:
        self._refresh_batching()
        return self._render_nv().encode() + generate_latest(self.registry)
