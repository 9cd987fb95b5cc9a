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
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()]

    def ask(prompt: str) -> int:
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    ask(questions[0])
    print(f"after one request: {resident_mb(args.server_pid)}")
    for concurrency in map(int, args.concurrency.split(",")):
        prompts = [questions[i % len(questions)] for i in range(max(16, concurrency))]
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(ask, prompts))
        print(f"concurrency {concurrency}: {tokens / (time.perf_counter() - start):.1f} tok/s over {tokens} tokens"
              f" ({len(prompts)} requests); {resident_mb(args.server_pid)}")


def resident_mb(pid: int | None) -> str:
    """The process's resident and peak resident memory, from /proc (Linux)."""
    if pid is None:
        return "server memory not asked for"
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    mb = lambda key: int(fields[key].split()[0]) // 1024
    return f"server RSS {mb('VmRSS')} MB (peak {mb('VmHWM')} MB)"


if __name__ == "__main__":
    main()
