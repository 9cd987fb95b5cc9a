"""Time to ready and resident memory of `specserve serve` against llama.cpp's `llama-server` on one GGUF.

    python benchmarks/start_and_memory.py /path/model.gguf [--ctx 4096] [--starts 2]

Each server is started `--starts` times in a row (the first of specserve's may fill its cache; the later ones are
the "second start"), timed from the process's launch to the first 200 of its readiness route, then sent one greedy
completion of 64 tokens; its resident memory (VmRSS, and the peak VmHWM) is read after that request. llama-server
runs with `-c CTX` and the machine's thread count; its binary is the native build's
(`python -m specserve.bench.native_llamacpp`) or $SPECSERVE_LLAMA_SERVER. The cache's size is reported against
the file's. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specserve.bench.native_llamacpp import server_binary

PROMPT = "Explain in a few sentences why the sky is blue."


def resident_mb(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) // 1024}


def serve(command: list[str], ready_url: str, complete, timeout_s: float = 600.0) -> dict:
    """Launch, wait for readiness, one completion, memory; then stop the server."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode} before it was ready")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{command[0]} was not ready within {timeout_s:.0f} s")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ready_s = time.perf_counter() - start
        complete()
        return {"ready_s": round(ready_s, 2), **resident_mb(process.pid)}
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def specserve_start(gguf: Path, port: int) -> dict:
    command = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(gguf), "--http-port", str(port),
               "--metrics-port", str(port + 1), "--allow-grpc", "false", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"

    def complete() -> None:
        body = {"model": gguf.stem, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()

    return serve(command, f"{url}/v2/health/ready", complete)


def llama_server_start(binary: Path, gguf: Path, port: int, ctx: int) -> dict:
    command = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(os.cpu_count() or 1), "-c", str(ctx),
               "-np", "1"]
    url = f"http://127.0.0.1:{port}"

    def complete() -> None:
        body = {"prompt": PROMPT, "n_predict": 64, "temperature": 0.0, "top_k": 1}
        httpx.post(f"{url}/completion", json=body, timeout=600).raise_for_status()

    return serve(command, f"{url}/health", complete)


def cache_mb(gguf: Path) -> float | None:
    """Size of specserve's cache directory for this file (the newest one whose name starts with its stem)."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specserve" / "gguf"
    dirs = sorted(root.glob(f"{gguf.stem.lower()}-*"), key=lambda d: d.stat().st_mtime)
    if not dirs:
        return None
    return sum(f.stat().st_size for f in dirs[-1].iterdir()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--ctx", type=int, default=4096, help="llama-server's context (-c)")
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--port", type=int, default=8310)
    args = parser.parse_args()
    for i in range(args.starts):
        print(f"specserve serve, start {i + 1}: {specserve_start(args.gguf, args.port)}", flush=True)
    binary = server_binary()
    if binary is None:
        print("llama-server: not built (python -m specserve.bench.native_llamacpp)")
    else:
        for i in range(args.starts):
            print(f"llama-server -c {args.ctx}, start {i + 1}: "
                  f"{llama_server_start(binary, args.gguf, args.port + 2, args.ctx)}", flush=True)
    file_mb = args.gguf.stat().st_size / 2**20
    cached = cache_mb(args.gguf)
    print(f"file {file_mb:.0f} MB; specserve cache "
          + (f"{cached:.0f} MB ({cached / file_mb:.2f}x the file)" if cached else "not found"))


if __name__ == "__main__":
    main()
