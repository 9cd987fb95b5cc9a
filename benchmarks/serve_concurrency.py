"""Output tokens/s of a running `specserve serve` at concurrency 1 and 8 (OpenAI completions, greedy).

    specserve serve --http-port 8123 &
    python benchmarks/serve_concurrency.py --port 8123 --server-pid $!

One warm-up request, then the first 16 questions of general_questions.jsonl one after another, then 8 at a time
(`--concurrency 1,8,32`: other levels; a level above 16 cycles through the questions to fill itself). With
`--server-pid`, the server's resident memory after each level. Local servers only: the address is 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

QUESTIONS = Path(__file__).with_name("general_questions.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--server-pid", type=int, help="report this process's resident memory")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    for level, result in measure(args.port, args.model, args.max_tokens, levels, args.server_pid).items():
        print(f"concurrency {level}: {result['tokens_per_s']:.1f} tok/s over {result['tokens']} tokens"
              f" ({result['requests']} requests); {memory_text(result)}")


def measure(port: int, model: str, max_tokens: int, levels: list[int], server_pid: int | None = None) -> dict:
    """{level: tokens_per_s, tokens, requests and, with a pid, the server's rss_mb / peak_rss_mb after it}."""
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()]

    def ask(prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    ask(questions[0])  # warm-up
    results = {}
    for level in levels:
        prompts = [questions[i % len(questions)] for i in range(max(16, level))]
        start = time.perf_counter()
        with ThreadPoolExecutor(level) as pool:
            tokens = sum(pool.map(ask, prompts))
        results[level] = {"tokens_per_s": round(tokens / (time.perf_counter() - start), 2), "tokens": tokens,
                          "requests": len(prompts), **resident_mb(server_pid)}
    return results


def memory_text(result: dict) -> str:
    if "rss_mb" not in result:
        return "server memory not asked for"
    return f"server RSS {result['rss_mb']} MB (peak {result['peak_rss_mb']} MB)"


def resident_mb(pid: int | None) -> dict:
    """The process's resident and peak resident memory in MB, from /proc (Linux); {} without a pid."""
    if pid is None:
        return {}
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) // 1024}


if __name__ == "__main__":
    main()
