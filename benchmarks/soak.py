"""Soak a running `specserve serve`: many clients for many minutes, every output checked against its reference.

    specserve serve --http-port 8123 --metrics-port 8124 &
    python benchmarks/soak.py --port 8123 --server-pid $! --clients 32 --minutes 10 --max-tokens 128 \\
        --dataset benchmarks/general_questions.jsonl --json soak.json

First each prompt's reference output, one request at a time (OpenAI /v1/completions, greedy: temperature 0); then
`--clients` threads each loop over the prompts (each from its own place in the list) until `--minutes` are over,
and every output must equal its prompt's reference. Meanwhile the server's resident memory is sampled every
`--rss-every` seconds (psutil, else /proc/PID/status), and /metrics (on --metrics-port, default --port + 1) is read
at the start and the end for the draft tokens proposed and accepted and the verify steps that carried a draft.

Prints a summary (requests, errors by kind, mismatches, output tokens/s, RSS start/min/max/end, draft counts);
--json FILE writes it as JSON too. Exits 1 if any request failed or differed from its reference. Local servers
only: the address is 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# vLLM's speculative-decoding counters, as specserve's /metrics exports them (specserve/server/metrics.py)
DRAFT_METRICS = {"draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
                 "steps_with_draft": "vllm:spec_decode_num_drafts_total",
                 "output_tokens": "vllm:generation_tokens_total", "requests": "vllm:request_success_total"}


def load_prompts(path: Path) -> list[str]:
    """The first turn of each question (the EAGLE / MT-bench question.jsonl layout, as serve_concurrency.py reads)."""
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def served_model(client: httpx.Client) -> str:
    return client.get("/v1/models").raise_for_status().json()["data"][0]["id"]


def complete(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """(text, completion tokens) of one greedy completion; raises httpx.HTTPError."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    out = client.post("/v1/completions", json=body).raise_for_status().json()
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def error_kind(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


def rss_mb(pid: int) -> float:
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) / 1024


def sample_rss(pid: int, every: float, stop: threading.Event, samples: list[float]) -> None:
    while True:
        try:
            samples.append(rss_mb(pid))
        except Exception as exc:  # noqa: BLE001 - the server is gone: the clients' errors will say so
            print(f"memory sampling stopped: {exc!r}", flush=True)
            return
        if stop.wait(every):
            return


def draft_counts(metrics_url: str) -> dict[str, float]:
    """The DRAFT_METRICS counters, summed over their label sets (every model)."""
    text = httpx.get(metrics_url, timeout=30).raise_for_status().text
    totals = dict.fromkeys(DRAFT_METRICS, 0.0)
    for line in text.splitlines():
        match = re.match(r"([^\s{#]+)(\{.*\})?\s+(\S+)$", line)
        for key, name in DRAFT_METRICS.items():
            if match and match[1] == name:
                totals[key] += float(match[3])
    return totals


class Soak:
    """The clients' shared tally."""

    def __init__(self, prompts: list[str], references: list[str]):
        self.prompts, self.references = prompts, references
        self.lock = threading.Lock()
        self.requests, self.tokens = 0, 0
        self.errors: Counter[str] = Counter()
        self.mismatches: list[dict] = []

    def client(self, base_url: str, model: str, max_tokens: int, start: int, deadline: float) -> None:
        """One client: the prompts in turn from `start` until the deadline."""
        with httpx.Client(base_url=base_url, timeout=600) as http:
            i = start
            while time.monotonic() < deadline:
                index = i % len(self.prompts)
                i += 1
                try:
                    text, tokens = complete(http, model, self.prompts[index], max_tokens)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    self.record(error=error_kind(exc))
                    continue
                self.record(tokens=tokens, mismatch=None if text == self.references[index] else
                            {"prompt": index, "expected": self.references[index][:200], "got": text[:200]})

    def record(self, tokens: int = 0, error: str | None = None, mismatch: dict | None = None) -> None:
        with self.lock:
            self.requests += 1
            self.tokens += tokens
            if error:
                self.errors[error] += 1
            if mismatch:
                self.mismatches.append(mismatch)


def run(args) -> dict:
    base_url = f"http://127.0.0.1:{args.port}"
    metrics_url = f"http://127.0.0.1:{args.metrics_port or args.port + 1}/metrics"
    prompts = load_prompts(args.dataset)
    with httpx.Client(base_url=base_url, timeout=600) as http:
        model = args.model or served_model(http)
        print(f"{model}: references for {len(prompts)} prompts at concurrency 1 ...", flush=True)
        references = [complete(http, model, prompt, args.max_tokens)[0] for prompt in prompts]
    rss: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(args.server_pid, args.rss_every, stop, rss), daemon=True)
    if args.server_pid:
        sampler.start()
    drafts_before = draft_counts(metrics_url)
    soak = Soak(prompts, references)
    print(f"{args.clients} clients for {args.minutes} min ...", flush=True)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    offsets = [c * len(prompts) // args.clients for c in range(args.clients)]
    with ThreadPoolExecutor(args.clients) as pool:
        futures = [pool.submit(soak.client, base_url, model, args.max_tokens, offset, deadline) for offset in offsets]
        for future in futures:
            future.result()
    elapsed = time.monotonic() - start
    drafts_after = draft_counts(metrics_url)
    stop.set()
    if args.server_pid:
        sampler.join()
    drafts = {key: drafts_after[key] - drafts_before[key] for key in DRAFT_METRICS}
    return {
        "model": model, "clients": args.clients, "minutes": args.minutes, "max_tokens": args.max_tokens,
        "elapsed_s": round(elapsed, 1), "requests": soak.requests, "errors": dict(soak.errors),
        "mismatches": len(soak.mismatches), "mismatch_examples": soak.mismatches[:5],
        "output_tokens": soak.tokens, "tokens_per_s": round(soak.tokens / elapsed, 1),
        "rss_mb": {"start": round(rss[0], 1), "min": round(min(rss), 1), "max": round(max(rss), 1),
                   "end": round(rss[-1], 1), "samples": len(rss)} if rss else None,
        "drafts": {**drafts, "acceptance_rate": drafts["accepted_tokens"] / drafts["draft_tokens"]
                   if drafts["draft_tokens"] else None, "share_of_steps_with_draft": share_drafted(drafts)},
    }


def share_drafted(drafts: dict[str, float]) -> float | None:
    """Of the requests' decoding steps, the share that verified a draft. A request's forwards each emit one token
    plus the draft tokens accepted, the first forward (the prefill) none of them: decoding steps = output tokens
    - accepted tokens - requests."""
    steps = drafts["output_tokens"] - drafts["accepted_tokens"] - drafts["requests"]
    return drafts["steps_with_draft"] / steps if steps > 0 else None


def summary(result: dict) -> str:
    errors = ", ".join(f"{kind} x{n}" for kind, n in result["errors"].items()) or "none"
    rss = result["rss_mb"]
    drafts = result["drafts"]
    rate = f"{drafts['acceptance_rate']:.1%}" if drafts["acceptance_rate"] is not None else "-"
    lines = [
        f"model {result['model']}: {result['clients']} clients, {result['elapsed_s']} s, "
        f"max_tokens {result['max_tokens']}",
        f"requests {result['requests']}, errors {sum(result['errors'].values())} ({errors}), "
        f"mismatches {result['mismatches']}",
        f"output tokens {result['output_tokens']}: {result['tokens_per_s']} tok/s",
        f"server RSS MB: start {rss['start']:.0f}, min {rss['min']:.0f}, max {rss['max']:.0f}, end {rss['end']:.0f} "
        f"({rss['samples']} samples)" if rss else "server RSS: no --server-pid",
        f"drafts: {drafts['draft_tokens']:.0f} tokens proposed, {drafts['accepted_tokens']:.0f} accepted ({rate}), "
        f"{drafts['steps_with_draft']:.0f} verify steps carried a draft "
        f"({drafts['share_of_steps_with_draft'] or 0:.0%} of the decoding steps)",
    ]
    lines += [f"  mismatch on prompt {m['prompt']}: expected {m['expected'][:60]!r}, got {m['got'][:60]!r}"
              for m in result["mismatch_examples"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, help="default: --port + 1")
    parser.add_argument("--server-pid", type=int, help="sample this process's resident memory")
    parser.add_argument("--model", help="default: the first model /v1/models lists")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", type=Path, default=Path(__file__).with_name("general_questions.jsonl"))
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    result = run(args)
    print(summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    raise SystemExit(1 if result["errors"] or result["mismatches"] else 0)


if __name__ == "__main__":
    main()
