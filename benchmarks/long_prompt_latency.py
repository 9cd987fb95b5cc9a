"""A short request's latency next to a long prompt, and the first request after "ready" (docs/reliability.md).

    python benchmarks/long_prompt_latency.py --port 8123 [--prompt-tokens 8000] [--json FILE]

Starts `specserve serve` on the embedded default itself (so it can time the first request after ready), then:
1. the first request the moment `/v2/health/ready` says 200, and the steady latency (median of 5) of the same
   short request (OpenAI completions, greedy, `--max-tokens`);
2. a long prompt (`--prompt-tokens`, sent by a client in the background) and, while it is being prefilled, the
   short request 3 times: each latency against the idle one;
3. a long prompt whose client leaves after 3 s, then the short request at once (the server must drop the prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

QUESTIONS = Path(__file__).with_name("general_questions.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()]
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--http-port", str(args.port),
                               "--metrics-port", str(args.port + 1), "--log-level", "warning"])
    try:
        results = measure(url, questions, args)
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def measure(url: str, questions: list[str], args) -> dict:
    short = {"prompt": questions[3], "max_tokens": args.max_tokens, "temperature": 0}
    wait_until_ready(url)
    first = timed(url, short)
    idle = statistics.median(timed(url, short) for _ in range(5))
    long_body = {"prompt": long_text(questions, args.prompt_tokens), "max_tokens": 16, "temperature": 0}
    background = Background(url, long_body)
    time.sleep(1.0)
    beside_long = [timed(url, short) for _ in range(3)]
    long_seconds, prompt_tokens = background.join()
    leaving = Background(url, long_body, timeout=3.0)
    leaving.join()
    after_leaving = timed(url, short)
    return {"first_after_ready_s": first, "idle_s": idle, "first_after_ready_vs_idle": first / idle,
            "long_prompt_tokens": prompt_tokens, "long_request_s": long_seconds,
            "beside_long_prompt_s": beside_long, "beside_long_prompt_vs_idle": [t / idle for t in beside_long],
            "after_client_left_s": after_leaving, "after_client_left_vs_idle": after_leaving / idle}


def wait_until_ready(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise SystemExit("the server did not get ready")


def timed(url: str, body: dict) -> float:
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start


def long_text(questions: list[str], tokens: int) -> str:
    """About `tokens` tokens of text (~5 characters per token for these questions), varied rather than one
    sentence repeated, so no n-gram draft shortcut applies."""
    words, text = tokens * 5, []
    while sum(map(len, text)) < words:
        text.extend(questions)
    return " ".join(text)[:words]


class Background:
    """One request in a thread; `timeout` makes its client leave early."""

    def __init__(self, url: str, body: dict, timeout: float = 600.0):
        self.result: tuple[float, int] = (0.0, 0)
        self.thread = threading.Thread(target=self._run, args=(url, body, timeout), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict, timeout: float) -> None:
        start = time.perf_counter()
        try:
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
            self.result = (time.perf_counter() - start, reply.json()["usage"]["prompt_tokens"])
        except httpx.TimeoutException:
            self.result = (time.perf_counter() - start, 0)

    def join(self) -> tuple[float, int]:
        self.thread.join()
        return self.result


if __name__ == "__main__":
    main()
