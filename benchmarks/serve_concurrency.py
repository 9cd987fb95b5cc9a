"""Output tokens/s of a running `specserve serve` at concurrency 1 and 8 (OpenAI completions, greedy).

    specserve serve --http-port 8123 &
    python benchmarks/serve_concurrency.py --port 8123

One warm-up request, then the first 16 questions of general_questions.jsonl one after another, then 8 at a time.
Local servers only: the address is 127.0.0.1.
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
    args = parser.parse_args()
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()][:16]

    def ask(prompt: str) -> int:
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    ask(questions[0])
    for concurrency in (1, 8):
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(ask, questions))
        print(f"concurrency {concurrency}: {tokens / (time.perf_counter() - start):.1f} tok/s over {tokens} tokens")


if __name__ == "__main__":
    main()
