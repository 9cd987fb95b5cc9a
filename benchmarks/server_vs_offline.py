"""A running `specserve serve` at concurrency 1 next to the offline engine, pass by pass, on the same questions.

    specserve serve --http-port 8123 &
    python benchmarks/server_vs_offline.py --port 8123 --pairs 4

Each pair is one pass of the first 16 general questions (OpenAI completions, greedy, 128 tokens) through the
server, then one pass of the same questions through an offline engine built here from the server's default
config, as `specserve bench` runs it (`Engine.generate`, its time per request). This machine's speed drifts by
±20% between minutes, so only a pair's ratio means something; the server is idle while the offline pass runs, and
this process only waits while the server's does. Both sides get one untimed warm-up request first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from specserve.config import build_engine
from specserve.server.app import default_config
from specserve.speculative.sampling import SamplingParams

QUESTIONS = Path(__file__).with_name("general_questions.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()][:args.questions]
    engine = build_engine(default_config())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def server_pass(prompts: list[str]) -> tuple[float, list[str]]:
        start, tokens, texts = time.perf_counter(), 0, []
        for prompt in prompts:
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            reply = httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=600)
            reply.raise_for_status()
            tokens += reply.json()["usage"]["completion_tokens"]
            texts.append(reply.json()["choices"][0]["text"])
        return tokens / (time.perf_counter() - start), texts

    def offline_pass(prompts: list[str]) -> tuple[float, list[str]]:
        results = [engine.generate(prompt, params) for prompt in prompts]
        return (sum(r.metrics.output_tokens for r in results) / sum(r.metrics.total_time_s for r in results),
                [r.text for r in results])

    server_pass(questions[:1])
    offline_pass(questions[:1])
    ratios = []
    for pair in range(1, args.pairs + 1):
        served, served_texts = server_pass(questions)
        offline, offline_texts = offline_pass(questions)
        ratios.append(served / offline)
        same = sum(a == b for a, b in zip(served_texts, offline_texts))
        print(f"pair {pair}: server {served:.1f} tok/s, offline {offline:.1f} tok/s, ratio {served / offline:.3f}"
              f" (texts equal {same}/{len(questions)})", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f} over {len(ratios)} pairs")


if __name__ == "__main__":
    main()
