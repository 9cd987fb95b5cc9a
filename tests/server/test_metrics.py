"""Prometheus metrics on the metrics port: Triton's nv_inference_* families (labels model, version) and vLLM's
spec-decode counters, consistent with the per-request perf outputs."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3


def value(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def test_metrics_endpoint_format(server):
    text = server.metrics_text()
    assert "# TYPE nv_inference_request_success counter" in text
    assert 'nv_inference_request_success{model="tensorrt_llm",version="1"}' in text
    assert 'nv_inference_request_failure{model="tensorrt_llm",reason="REJECTED",version="1"}' in text
    for name in ("nv_inference_count", "nv_inference_exec_count", "nv_inference_request_duration_us",
                 "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                 "nv_inference_pending_request_count", "nv_model_load_duration_secs"):
        assert f"# TYPE {name} " in text, name
    families = {f.name for f in text_string_to_metric_families(text)}  # parses as Prometheus text
    assert "vllm:spec_decode_num_draft_tokens" in families or "vllm:spec_decode_num_draft_tokens" in text
    assert server.http.get("/metrics").status_code == 200  # also on the HTTP port, like vLLM


def test_counters_follow_requests(server):
    before = server.metrics_text()
    drafted = accepted = 0
    for _ in range(3):
        body = server.http.post("/v2/models/tensorrt_llm/generate", json={
            "text_input": PROMPT, "sampling_param_max_tokens": 24,
            "sampling_param_return_perf_metrics": True}).json()
        drafted += int(body["total_draft_tokens"])
        accepted += int(body["total_accepted_draft_tokens"])
    assert server.http.post("/v2/models/tensorrt_llm/generate", json={"text_input": "hi", "top_p": 9}
                            ).status_code == 400
    after = server.metrics_text()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    model = {"model": "tensorrt_llm", "version": "1"}
    assert delta("nv_inference_request_success", **model) == 3
    assert delta("nv_inference_count", **model) == 3 and delta("nv_inference_exec_count", **model) == 3
    assert delta("nv_inference_request_failure", **model) == 1
    assert delta("nv_inference_request_duration_us", **model) > 0
    assert delta("nv_inference_queue_duration_us", **model) >= 0
    assert value(after, "nv_inference_pending_request_count", **model) == 0
    assert drafted > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total", model_name="tensorrt_llm") == drafted
    assert delta("vllm:spec_decode_num_accepted_tokens_total", model_name="tensorrt_llm") == accepted
    drafts = delta("vllm:spec_decode_num_drafts_total", model_name="tensorrt_llm")
    undrafted = delta("specserve_spec_decode_undrafted_steps_total", model_name="tensorrt_llm")
    assert drafts > 0 and undrafted >= 0 and drafts + undrafted <= 3 * 23  # 24 tokens: at most 23 decoding steps
    per_pos = delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="tensorrt_llm")
    assert per_pos == accepted
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tensorrt_llm",position="0"}' in after
    tau = value(after, "specserve_spec_decode_mean_acceptance_length", model_name="tensorrt_llm")
    assert 1.0 <= tau <= 5.0
    assert delta("specserve_request_acceptance_length_count", model_name="tensorrt_llm") == 3
    assert delta("vllm:generation_tokens_total", model_name="tensorrt_llm") > 0


def test_separate_registries(server, slow_server):
    """Two servers in one process keep their own counts."""
    slow_server.http.post("/v2/models/slow/generate", json={"text_input": "hi", "sampling_param_max_tokens": 2})
    assert 'model="slow"' in slow_server.metrics_text()
    assert 'model="slow"' not in server.metrics_text()


def test_batching_gauges_say_what_the_scheduler_did(server):
    r = server.http.post("/v2/models/tensorrt_llm/generate", json={"text_input": PROMPT,
                                                                    "sampling_param_max_tokens": 12})
    assert r.status_code == 200
    text = server.metrics_text()
    assert value(text, "specserve_batch_size", model_name="tensorrt_llm") >= 1
    assert 0 <= value(text, "specserve_spec_decode_draft_len", model_name="tensorrt_llm") <= 4
    assert "# TYPE specserve_spec_decode_draft_len gauge" in text
