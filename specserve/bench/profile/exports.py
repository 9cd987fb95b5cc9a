"""`specserve profile`'s exports and console: the profile export file (perf_analyzer's schema plus a `specserve`
block), `<stem>_genai_perf.json` and `.csv` in genai-perf's layout, and genai-perf's console table."""

from __future__ import annotations

import csv
import hashlib
import json
from specserve.bench.profile.config import ProfileError
from specserve.bench.profile.metrics import REQUEST_METRICS, STREAMING_ONLY, SYSTEM_METRICS
from specserve.bench.profile.result import ProfileResult

PROFILER_VERSION = "specserve-profile 1"


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
