"""`specserve profile compare BASE.json SPEC.json`: the tutorials' last step (compare the base model's genai-perf run
with the speculative model's) done by the tool: speedup per metric, the server-reported acceptance, whether the
outputs are identical request by request, and a plot.

BASE / SPEC are the profile export files `specserve profile` wrote (or their `<stem>_genai_perf.json`, whose profile
export file is found beside it). Runs over different inputs (prompts, output lengths, extra inputs) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.profile import metric_label

# (metric, unit, statistic, lower is better)
COMPARED = [("request_latency", "ms", "avg", True), ("request_latency", "ms", "p50", True),
            ("request_latency", "ms", "p99", True), ("time_to_first_token", "ms", "avg", True),
            ("inter_token_latency", "ms", "avg", True), ("output_token_throughput", "tokens/sec", "avg", False),
            ("request_throughput", "per sec", "avg", False)]
STREAMING_ONLY = {"time_to_first_token", "inter_token_latency"}


class CompareError(Exception):
    """Unreadable runs or runs that cannot be compared: printed without a traceback."""


@dataclass
class Run:
    path: Path
    doc: dict

    @property
    def meta(self) -> dict:
        return self.doc["specserve"]

    @property
    def requests(self) -> list[dict]:
        return self.doc["experiments"][0]["requests"]

    @property
    def label(self) -> str:
        return self.meta.get("model", self.path.stem)

    @property
    def stats(self) -> dict:
        return self.meta.get("stats") or {}

    def latencies_ms(self) -> list[float]:
        out = []
        for request in self.requests:
            metrics = request["specserve"].get("metrics_ns")
            if metrics:
                out.append(metrics["request_latency"] / 1e6)
        return out


def load_run(path: str | Path) -> Run:
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompareError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CompareError(f"{path} is not JSON ({exc.msg})") from None
    if isinstance(doc, dict) and "input_config" in doc and "experiments" not in doc:  # <stem>_genai_perf.json
        sibling = path.with_name(path.name.removesuffix("_genai_perf.json") + ".json")
        if sibling == path or not sibling.exists():
            raise CompareError(f"{path} is a genai-perf summary; its profile export file {sibling} is missing")
        return load_run(sibling)
    if not isinstance(doc, dict) or "specserve" not in doc or not doc.get("experiments"):
        raise CompareError(f"{path} is not a profile export written by `specserve profile` (no per-request outputs "
                           "to compare)")
    return Run(path, doc)


def _outputs_by_index(run: Run) -> dict[int, dict]:
    return {r["specserve"]["index"]: r["specserve"] for r in run.requests}


def compare_runs(base: Run, spec: Run) -> dict:
    """The comparison as a dict (what `--json` writes). Raises CompareError when the inputs differ."""
    if base.meta.get("inputs_hash") != spec.meta.get("inputs_hash"):
        b, s = _outputs_by_index(base), _outputs_by_index(spec)
        if len(b) != len(s):
            detail = f"{len(b)} requests vs {len(s)}"
        else:
            diff = [i for i in sorted(b) if b[i]["input_hash"] != s.get(i, {}).get("input_hash")]
            detail = f"{len(diff)} of {len(b)} requests differ, the first at index {diff[0]}" if diff else "hash"
        raise CompareError(f"the two runs did not send the same inputs ({detail}): profile both with the same "
                           "--input-file, --request-count, --output-tokens-* and --extra-inputs")
    metrics = []
    streaming = bool(base.meta.get("streaming")) and bool(spec.meta.get("streaming"))
    for name, unit, stat, lower in COMPARED:
        if name in STREAMING_ONLY and not streaming:  # without streaming TTFT is the request latency
            continue
        bv = (base.stats.get(name) or {}).get(stat)
        sv = (spec.stats.get(name) or {}).get(stat)
        if bv is None or sv is None:
            continue
        speedup = (bv / sv if sv else None) if lower else (sv / bv if bv else None)
        metrics.append({"metric": name, "unit": unit, "stat": stat, "base": bv, "spec": sv, "speedup": speedup})
    b, s = _outputs_by_index(base), _outputs_by_index(spec)
    both = [i for i in sorted(b) if i in s and not b[i].get("error") and not s[i].get("error")]
    different = [i for i in both if b[i]["output_text"] != s[i]["output_text"]]
    failed = {"base": [i for i in sorted(b) if b[i].get("error")], "spec": [i for i in sorted(s) if s[i].get("error")]}
    first = None
    if different:
        i = different[0]
        x, y = b[i]["output_text"], s[i]["output_text"]
        at = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
        first = {"index": i, "char": at, "base": x[max(0, at - 20):at + 40], "spec": y[max(0, at - 20):at + 40]}
    greedy = all(_greedy(run) for run in (base, spec))
    return {
        "base": {"file": str(base.path), "model": base.label, "url": base.meta.get("url")},
        "spec": {"file": str(spec.path), "model": spec.label, "url": spec.meta.get("url")},
        "inputs_hash": base.meta.get("inputs_hash"), "requests": len(b), "metrics": metrics,
        "acceptance": {"base": _acceptance(base), "spec": _acceptance(spec)},
        "outputs": {"compared": len(both), "identical": len(both) - len(different), "different": different,
                    "all_identical": not different and bool(both), "first_difference": first, "greedy": greedy,
                    "failed": failed},
    }


def _greedy(run: Run) -> bool:
    extra = (run.meta.get("input_config") or {}).get("extra_inputs") or {}
    return all(float(extra.get(k, 0) or 0) == 0 for k in ("temperature", "sampling_param_temperature"))


def _acceptance(run: Run) -> dict | None:
    perf = run.meta.get("server_perf_metrics")
    server = run.meta.get("server_spec_decode_metrics")
    if not perf and not server:
        return None
    out = {}
    if perf:
        out.update({k: perf[k] for k in ("acceptance_rate", "mean_request_acceptance_rate", "mean_acceptance_length",
                                         "total_draft_tokens", "total_accepted_draft_tokens") if k in perf})
        out["source"] = "responses (sampling_param_return_perf_metrics)"
        out["length_label"] = "tokens per target forward"
    elif server:
        out.update({"acceptance_rate": server["acceptance_rate"],
                    "mean_acceptance_length": server["mean_acceptance_length"],
                    "total_draft_tokens": server["num_draft_tokens"],
                    "total_accepted_draft_tokens": server["num_accepted_tokens"],
                    "source": "server /metrics (vllm:spec_decode_*)",
                    "length_label": "mean acceptance length (1 + accepted / drafts)"})
    return out


def format_report(report: dict) -> str:
    lines = [f"base: {report['base']['model']} ({report['base']['file']})",
             f"spec: {report['spec']['model']} ({report['spec']['file']})",
             f"inputs: {report['requests']} requests, identical (sha256 {report['inputs_hash'][:12]})", ""]
    rows = [("Metric", "base", "spec", "speedup")]
    for m in report["metrics"]:
        label = metric_label(m["metric"], m["unit"])
        if m["stat"] != "avg":
            label = label.replace(" (", f" {m['stat']} (", 1)
        speedup = f"{m['speedup']:.2f}x" if m["speedup"] is not None else "N/A"
        rows.append((label, f"{m['base']:,.2f}", f"{m['spec']:,.2f}", speedup))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for k, row in enumerate(rows):
        lines.append("  ".join(row[0].rjust(widths[0]) if i == 0 else row[i].rjust(widths[i]) for i in range(4)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    for side in ("base", "spec"):
        acc = report["acceptance"][side]
        if acc:
            text = f"acceptance ({side}, from {acc['source']}): rate {acc['acceptance_rate']:.3f}"
            if "mean_acceptance_length" in acc:
                text += f", {acc['length_label']} {acc['mean_acceptance_length']:.2f}"
            if "total_draft_tokens" in acc:
                text += f" ({acc['total_accepted_draft_tokens']}/{acc['total_draft_tokens']} draft tokens accepted)"
            lines.append(text)
        else:
            lines.append(f"acceptance ({side}): not reported by the server")
    out = report["outputs"]
    for side, failed in out["failed"].items():
        if failed:
            lines.append(f"warning: {len(failed)} request(s) failed in the {side} run (indexes {failed[:10]}); "
                         "outputs compared on the others")
    if out["all_identical"]:
        lines.append(f"outputs: identical, {out['identical']}/{out['compared']} requests"
                     + ("" if out["greedy"] else " (sampling was not greedy)"))
    else:
        lines.append(f"outputs: DIFFERENT: {len(out['different'])} of {out['compared']} requests differ "
                     f"(indexes {out['different'][:20]})")
        if out["first_difference"]:
            d = out["first_difference"]
            lines.append(f"  first difference: request {d['index']}, character {d['char']}: base {d['base']!r} "
                         f"vs spec {d['spec']!r}")
        if out["greedy"]:
            lines.append("  both runs were greedy (temperature 0), so lossless speculation should give identical "
                         "outputs")
    return "\n".join(lines)


def plot(base: Run, spec: Run, report: dict, path: str | Path) -> Path:
    """Latency distribution (box + points per request) and output token throughput side by side (PNG)."""
    try:
        import matplotlib
    except ImportError:
        raise CompareError("--plot needs matplotlib: pip install 'specserve[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    names = [f"base: {base.label}\n{base.path.name}", f"spec: {spec.label}\n{spec.path.name}"]
    colors = ["#8c8c8c", "#2a7ab9"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    data = [base.latencies_ms(), spec.latencies_ms()]
    if all(data):
        left.boxplot(data, widths=0.5, showfliers=False)
        left.set_xticks([1, 2], names)
    for k, values in enumerate(data):
        xs = [k + 1 + 0.12 * ((i % 7) - 3) / 3 for i in range(len(values))]
        left.scatter(xs, values, s=14, alpha=0.7, color=colors[k], zorder=3)
    left.set_xticks([1, 2], names)
    left.set_ylabel("request latency (ms)")
    left.set_title("Request latency per request")
    left.grid(axis="y", alpha=0.3)
    values = [(r.stats.get("output_token_throughput") or {}).get("avg", 0.0) for r in (base, spec)]
    bars = right.bar(names, values, color=colors, width=0.5)
    for bar, value in zip(bars, values):
        right.annotate(f"{value:,.1f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    speedup = next((m["speedup"] for m in report["metrics"] if m["metric"] == "output_token_throughput"), None)
    right.set_title("Output token throughput" + (f" ({speedup:.2f}x)" if speedup else ""))
    right.set_ylabel("tokens/sec")
    right.grid(axis="y", alpha=0.3)
    same = report["outputs"]
    fig.suptitle(f"base vs speculative: {report['requests']} requests, outputs "
                 f"{'identical' if same['all_identical'] else 'DIFFERENT'}")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise CompareError(f"cannot write the plot {path}: {exc}") from None
    finally:
        plt.close(fig)
    return path
