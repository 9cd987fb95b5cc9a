"""llama.cpp built natively, as users run it: the bench's `llamacpp-native` method and the build that makes it.

`build()` compiles llama.cpp's own `llama-server` and `llama-bench` (CMake, CPU only, `GGML_NATIVE`: the build
machine's instructions) from the llama.cpp source that the pinned llama-cpp-python release vendors, so the peer is
the same llama.cpp the `llamacpp` method loads through Python, without that binding's per-token Python loop
(`python -m specserve.bench.native_llamacpp`, 8-15 minutes on 2 cores; the binaries go to the cache). The build
must run: where its `llama-bench` crashes on the embedded default model and the CPU has AMX, it is built again
without ggml's AMX backend (with GCC 12 on a 2-core Xeon its AMX matmul segfaulted), on its AVX-512 path.

`NativeServer` runs `llama-server` on the same GGUF; `native_runner` sends it the very prompt token ids specserve's
tokenizer makes (greedy: top-k 1, temperature 0, no prompt cache between requests) and times each request by
llama.cpp's own timings, prompt and decode apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from specserve.bench.method_run import MethodRun

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the release `specserve[llamacpp]` pins; its sdist vendors llama.cpp
TARGETS = ("llama-server", "llama-bench")
SERVER_ENV = "SPECSERVE_LLAMA_SERVER"  # a llama-server binary to use instead of the cached build


def install_dir() -> Path:
    from specserve.models.loader import cache_root

    return cache_root() / "llama.cpp" / LLAMA_CPP_PYTHON.split("==")[1]


def server_binary() -> Path | None:
    """$SPECSERVE_LLAMA_SERVER, else the cached native build's llama-server, else None."""
    path = Path(os.environ[SERVER_ENV]) if os.environ.get(SERVER_ENV) else install_dir() / "bin" / "llama-server"
    return path if path.is_file() else None


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # GCC: explicit -mno-* flags win over -march=native's


def build(out: Path | None = None, jobs: int | None = None) -> Path:
    """Download the pinned sdist, build llama.cpp's CPU tools natively, copy them to `out/bin`; returns `out`."""
    out = out or install_dir()
    with tempfile.TemporaryDirectory(prefix="llamacpp-build-") as scratch:
        work = Path(scratch)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_PYTHON, "-d", str(work)], check=True)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = work / "build"
        amx = compile_working_tools(source, build_dir, jobs)
        (out / "bin").mkdir(parents=True, exist_ok=True)
        for target in TARGETS:
            shutil.copy2(build_dir / "bin" / target, out / "bin" / target)
    (out / "BUILD").write_text(json.dumps({"source": LLAMA_CPP_PYTHON, "native": True, "cpu_only": True,
                                           "amx": amx}) + "\n")
    return out


def compile_working_tools(source: Path, build_dir: Path, jobs: int | None) -> bool:
    """Build the tools into `build_dir`; again without ggml's AMX backend where the first build's llama-bench
    crashes on a CPU with AMX. Returns whether the tools use AMX."""
    compile_tools(source, build_dir, jobs)
    if not cpu_has_amx():
        return False
    if runs(build_dir / "bin" / "llama-bench"):
        return True
    print("llama-bench crashed with ggml's AMX backend: building it again without AMX", file=sys.stderr)
    shutil.rmtree(build_dir)
    compile_tools(source, build_dir, jobs, (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"))
    return False


def compile_tools(source: Path, build_dir: Path, jobs: int | None, flags: tuple[str, ...] = ()) -> None:
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
                    "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs or os.cpu_count()),
                    "--target", *TARGETS], check=True)


def runs(llama_bench: Path) -> bool:
    """Whether `llama_bench` gets through an 8-token prompt and one token of the embedded default model."""
    from specserve.models.loader import embedded_default_gguf

    smoke = [str(llama_bench), "-m", str(embedded_default_gguf()), "-p", "8", "-n", "1", "-r", "1", "-t", "1"]
    return subprocess.run(smoke, capture_output=True, timeout=300).returncode == 0


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NativeServer:
    """llama-server on `gguf`, `threads` threads, one slot, on a free local port; stopped by `close`."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int = 4096, timeout_s: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(context), "-np", "1", "--host", "127.0.0.1",
             "--port", str(self.port), "--no-webui"], stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited ({self.process.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server was not ready within {timeout_s:.0f} s")

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        """One greedy completion of the token ids: llama-server's response (tokens, timings, stop_type)."""
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "return_tokens": True, "stream": False}
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


class NativeRunner:
    """The bench's runner for `llamacpp-native` (offline.TimedRunner's interface): a request per step, timed by
    llama.cpp's own prompt_ms + predicted_ms; decode and prefill rates kept apart as well."""

    def __init__(self, server: NativeServer, tokenizer, first_prompt: str, max_tokens: int):
        self.server, self.tokenizer, self.max_tokens = server, tokenizer, max_tokens
        start = time.perf_counter()
        self.request(first_prompt)
        self.run = MethodRun(warmup_s=time.perf_counter() - start)
        self.decode_ms = self.prompt_ms = 0.0
        self.decoded = self.prompted = 0

    def request(self, prompt: str) -> dict:
        return self.server.complete(self.tokenizer(prompt).input_ids, self.max_tokens)

    def step(self, prompt: str) -> None:
        answer = self.request(prompt)
        timings = answer["timings"]
        tokens = [int(t) for t in answer.get("tokens", [])]
        self.run.outputs.append(tokens)
        self.run.output_tokens += int(timings["predicted_n"])
        self.run.seconds += (timings["prompt_ms"] + timings["predicted_ms"]) / 1e3
        self.decode_ms += timings["predicted_ms"]
        self.decoded += int(timings["predicted_n"])
        self.prompt_ms += timings["prompt_ms"]
        self.prompted += int(timings["prompt_n"])

    def finish(self):
        self.server.close()
        self.run.method_state = {
            "llamacpp_build": "native (llama-server, GGML_NATIVE, CPU only)",
            "decode_tokens_per_s": round(1e3 * self.decoded / self.decode_ms, 3) if self.decode_ms else None,
            "prefill_tokens_per_s": round(1e3 * self.prompted / self.prompt_ms, 3) if self.prompt_ms else None}
        return self.run


def native_runner(target, first_prompt: str, max_tokens: int) -> NativeRunner:
    from specserve.config import ConfigError

    if target.gguf is None:
        raise ConfigError(f"llamacpp-native runs GGUF models only, and {target.name} is not one")
    binary = server_binary()
    if binary is None:
        raise ConfigError("llamacpp-native needs llama.cpp built natively: python -m specserve.bench.native_llamacpp "
                          f"(8-15 minutes), or {SERVER_ENV}=<a llama-server binary>")
    return NativeRunner(NativeServer(binary, target.gguf, os.cpu_count() or 1), target.tokenizer, first_prompt,
                        max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description="Build llama.cpp's llama-server and llama-bench natively from "
                                                 f"the llama.cpp source that {LLAMA_CPP_PYTHON} vendors.")
    parser.add_argument("--out", type=Path, default=None, help=f"install folder (default: {install_dir()})")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    args = parser.parse_args()
    print(build(args.out, args.jobs))


if __name__ == "__main__":
    main()
