"""Latency and output tokens/s of one running `specserve serve` over KServe gRPC and over HTTP, same requests.

    specserve serve &                                           # HTTP 8000, gRPC 8001
    python benchmarks/grpc_vs_http.py --model tensorrt_llm --max-tokens 64 --requests 16 --concurrency 1,8

Each level sends `--requests` requests (the questions of general_questions.jsonl, cycled), `--concurrency` at a
time, greedy, exactly `--max-tokens` tokens each (`min_length` = `max_tokens`: EOS ignored), over:

- `grpc`    ModelInfer (tritonclient.grpc)              vs  `http`    KServe `/v2/models/<m>/infer` (JSON tensors)
- `grpc-stream` ModelStreamInfer, one open stream per client thread, deltas (`stream: true`)
            vs  `http-stream` `/v2/models/<m>/generate_stream` (SSE)

and prints per protocol and level: requests, latency mean / p50 / p99 (ms), time to first response for the streams,
and output tokens/s (tokens / wall time of the level). Every output is compared with the `http` one of the same
prompt (greedy: they must be equal). One untimed warm-up request per protocol. Loopback only (127.0.0.1);
`--json FILE` writes the table too.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient

QUESTIONS = Path(__file__).with_name("general_questions.jsonl")
HOST = "127.0.0.1"
PROTOCOLS = ("grpc", "http", "grpc-stream", "http-stream")


def request_values(prompt: str, max_tokens: int, stream: bool) -> dict:
    """The inputs every Triton style accepts (genai-perf's spelling): a fixed-length greedy answer."""
    values = {"text_input": prompt, "max_tokens": max_tokens, "min_length": max_tokens, "temperature": 0.0,
              "exclude_input_in_output": True}
    return {**values, "stream": True} if stream else values


def grpc_inputs(values: dict) -> list[grpcclient.InferInput]:
    items = []
    for name, value in values.items():
        kind, dtype = {str: ("BYTES", object), bool: ("BOOL", np.bool_), int: ("INT32", np.int32),
                       float: ("FP32", np.float32)}[type(value)]
        item = grpcclient.InferInput(name, [1], kind)
        item.set_data_from_numpy(np.array([value], dtype=dtype))
        items.append(item)
    return items


def http_tensors(values: dict) -> list[dict]:
    kinds = {str: "BYTES", bool: "BOOL", int: "INT32", float: "FP32"}
    return [{"name": name, "datatype": kinds[type(value)], "shape": [1], "data": [value]}
            for name, value in values.items()]


class Client:
    """One client thread's connections: an HTTP client, a gRPC client and (for the streams) one open stream."""

    def __init__(self, args):
        self.args = args
        self.http = httpx.Client(base_url=f"http://{HOST}:{args.http_port}", timeout=600)
        self.grpc = grpcclient.InferenceServerClient(f"{HOST}:{args.grpc_port}")
        self.responses: queue.Queue | None = None

    def run(self, protocol: str, prompt: str) -> tuple[str, float, float]:
        """(output text, seconds to the first response, seconds to the end) of one request."""
        start = time.perf_counter()
        text, first = getattr(self, "_" + protocol.replace("-", "_"))(prompt)
        return text, first - start, time.perf_counter() - start

    def _grpc(self, prompt: str) -> tuple[str, float]:
        result = self.grpc.infer(self.args.model, grpc_inputs(request_values(prompt, self.args.max_tokens, False)))
        return result.as_numpy("text_output").reshape(-1)[0].decode(), time.perf_counter()

    def _http(self, prompt: str) -> tuple[str, float]:
        body = {"inputs": http_tensors(request_values(prompt, self.args.max_tokens, False))}
        reply = self.http.post(f"/v2/models/{self.args.model}/infer", json=body)
        reply.raise_for_status()
        output = next(o for o in reply.json()["outputs"] if o["name"] == "text_output")
        return output["data"][0], time.perf_counter()

    def _grpc_stream(self, prompt: str) -> tuple[str, float]:
        if self.responses is None:
            self.responses = queue.Queue()
            self.grpc.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self.grpc.async_stream_infer(self.args.model, grpc_inputs(request_values(prompt, self.args.max_tokens, True)))
        pieces, first = [], None
        while True:
            result, error = self.responses.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"gRPC stream error: {error}")
            first = first or time.perf_counter()
            pieces.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "".join(pieces), first

    def _http_stream(self, prompt: str) -> tuple[str, float]:
        body = request_values(prompt, self.args.max_tokens, True)
        pieces, first = [], None
        with self.http.stream("POST", f"/v2/models/{self.args.model}/generate_stream", json=body) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    first = first or time.perf_counter()
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"HTTP stream error: {event['error']}")
                    pieces.append(event["text_output"])
        return "".join(pieces), first

    def close(self) -> None:
        if self.responses is not None:
            self.grpc.stop_stream()
        self.grpc.close()
        self.http.close()


def level(args, protocol: str, concurrency: int, prompts: list[str]) -> dict:
    """One protocol at one concurrency: every prompt once, `concurrency` client threads."""
    local = threading.local()
    clients: list[Client] = []
    lock = threading.Lock()

    def one(prompt: str):
        if not hasattr(local, "client"):
            local.client = Client(args)
            with lock:
                clients.append(local.client)
        return local.client.run(protocol, prompt)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    for client in clients:
        client.close()
    latencies = sorted(total * 1000 for _, _, total in results)
    firsts = sorted(first * 1000 for _, first, _ in results)
    row = {"protocol": protocol, "concurrency": concurrency, "requests": len(prompts),
           "latency_ms": summary(latencies), "tokens_per_s": len(prompts) * args.max_tokens / wall,
           "outputs": [text for text, _, _ in results]}
    if protocol.endswith("stream"):
        row["first_response_ms"] = summary(firsts)
    return row


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted values."""
    rank = max(1, int(np.ceil(p / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--model", default="tensorrt_llm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16, help="requests per protocol and level (at most 256)")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    if not 1 <= args.requests <= 256:
        parser.error("--requests must be in 1..256")
    protocols = args.protocols.split(",")
    unknown = set(protocols) - set(PROTOCOLS)
    if unknown:
        parser.error(f"unknown protocol(s) {sorted(unknown)}; choose from {PROTOCOLS}")
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()]
    prompts = [questions[i % len(questions)] for i in range(args.requests)]
    for protocol in protocols:  # warm-up, untimed
        level(args, protocol, 1, prompts[:1])
    rows = [level(args, protocol, concurrency, prompts)
            for concurrency in map(int, args.concurrency.split(",")) for protocol in protocols]
    reference = {row["concurrency"]: row["outputs"] for row in rows if row["protocol"] == protocols[0]}
    print(f"{'protocol':<12} {'conc':>4} {'reqs':>4} {'mean ms':>9} {'p50 ms':>9} {'p99 ms':>9} {'first p50':>9} "
          f"{'tok/s':>8}  outputs")
    for row in rows:
        lat, first = row["latency_ms"], row.get("first_response_ms", {}).get("p50")
        row["outputs_equal"] = row["outputs"] == reference[row["concurrency"]]
        print(f"{row['protocol']:<12} {row['concurrency']:>4} {row['requests']:>4} {lat['mean']:>9.1f} "
              f"{lat['p50']:>9.1f} {lat['p99']:>9.1f} {'-' if first is None else f'{first:.1f}':>9} "
              f"{row['tokens_per_s']:>8.1f}  {'equal' if row['outputs_equal'] else 'DIFFER'} to {protocols[0]}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                         "rows": [{k: v for k, v in row.items() if k != "outputs"} for row in rows]},
                                        indent=2))


if __name__ == "__main__":
    main()
