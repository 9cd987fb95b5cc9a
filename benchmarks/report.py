"""Regenerate the figures the README and docs/benchmarks.md show, on this machine, in one run.

    python benchmarks/report.py            # the full set: about an hour on a 2-core CPU
    python benchmarks/report.py --quick    # a few minutes: 4 prompts of each set, fewer methods, no server

Each part is one `specserve bench` (or server) run, so every ratio in it is measured side by side: same machine,
prompts and token ids, warm-up excluded. The run writes

* `docs/results/<cpu>.json`: every figure, the commands that produced them, the CPU (model, cores, kernel path);
* `docs/results/<cpu>-speed.png` (tokens/s of each method against `ar`, per prompt set) and
  `docs/results/<cpu>-step-costs.png` (a forward of k tokens against one);
* the README's results table, between its `results:start` / `results:end` markers, from that JSON.

Peers join when installed: llama.cpp built natively (`python -m specserve.bench.native_llamacpp`, the
`llamacpp-native` rows) and through llama-cpp-python (`pip install 'specserve[llamacpp]'`) in the offline sets; HF
transformers with `--hf`. Run it with nothing else on the machine: two processes on two cores slow each other
several times over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import httpx

from specserve.bench.native_llamacpp import server_binary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
HUMANEVAL = ROOT.parent / "shared" / "data" / "humaneval_question.jsonl"
GENERAL = ROOT / "benchmarks" / "general_questions.jsonl"
START, END = "<!-- results:start -->", "<!-- results:end -->"
FULL_METHODS = "ar,ngram,suffix,eagle3,eagle3+ngram,eagle,eagle2,medusa"
QUICK_METHODS = "ar,ngram,eagle3+ngram"


def cpu() -> dict:
    """The CPU's model name, cores and the widest kernel path specserve picks on it."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"model name\s*:\s*(.+)", info)
    found = re.search(r"flags\s*:\s*(.+)", info)
    flags = set(found.group(1).split()) if found else set()
    path = ("amx" if "amx_int8" in flags else "avx512-vnni" if "avx512_vnni" in flags
            else "avx2" if "avx2" in flags else "generic")
    model = name.group(1).strip() if name else platform.processor() or "unknown CPU"
    slug = re.sub(r"[^a-z0-9]+", "-", f"{model} {os.cpu_count()}c {path}".lower()).strip("-")
    return {"model": model, "cores": os.cpu_count(), "kernel_path": path, "slug": slug}


def specserve(*args: str) -> None:
    print("$ specserve " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "specserve.cli", *args], check=True, cwd=ROOT)


def bench(dataset: Path, methods: str, prompts: int, tokens: int, extra: tuple[str, ...] = ()) -> dict:
    """One `specserve bench` run: its JSON, with the command that made it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        args = ("bench", "--dataset", str(dataset), "--methods", methods, "--num-prompts", str(prompts),
                "--max-tokens", str(tokens), *extra, "--json", str(out))
        specserve(*args)
        report = json.loads(out.read_text())
    report["command"] = "specserve " + " ".join(shown_path(a) for a in args[:-2])
    return report


def shown_path(arg: str) -> str:
    """A path argument as the docs write it: relative to the repository (its parent: `..`)."""
    return arg.replace(str(ROOT) + os.sep, "").replace(str(ROOT.parent), "..")


def serve_levels(levels: list[int], tokens: int) -> dict:
    """Output tokens/s of `specserve serve` (the default model, n-gram) at each concurrency, and its memory."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_concurrency import measure

    port = 8123
    server = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--http-port", str(port),
                               "--metrics-port", "8124", "--allow-grpc", "false", "--log-level", "warning"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 900
        while not _ready(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(2)
        levels_out = measure(port, "gemma-3-270m", tokens, levels, server.pid)
    finally:
        server.terminate()
        server.wait(60)
    return {"levels": levels_out, "command": f"specserve serve --http-port {port} & python benchmarks/"
                                             f"serve_concurrency.py --port {port} --concurrency "
                                             f"{','.join(map(str, levels))} --max-tokens {tokens} --server-pid $!"}


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run(machine: dict, quick: bool, hf: bool, save) -> dict:
    """Every part in turn, the report saved after each (a part that fails leaves the ones before it)."""
    prompts, tokens = (4, 64) if quick else (20, 128)
    methods = (QUICK_METHODS if quick else FULL_METHODS) + (",hf,hf-pld" if hf else "")
    if server_binary() is not None:
        methods += ",llamacpp-native"
    if find_spec("llama_cpp") is not None:
        methods += ",llamacpp,llamacpp-pld"
    sets = {"general": GENERAL}
    if HUMANEVAL.exists():
        sets["humaneval"] = HUMANEVAL
    report = {"cpu": machine, "quick": quick, "date": time.strftime("%Y-%m-%d"), "offline": {}}
    for name, path in sets.items():
        report["offline"][name] = bench(path, methods, prompts, tokens)
        save(report)
    report["retry"] = bench(GENERAL, "ar,ngram,suffix", prompts // 2, tokens, ("--repeat", "2"))
    costs = bench(GENERAL, "ar", 1, 16, ("--step-costs",))
    report["step_costs"] = {"forward_ms_by_tokens": costs["forward_ms_by_tokens"], "roofline": costs["roofline"],
                            "command": costs["command"]}
    save(report)
    if not quick:
        report["server"] = serve_levels([1, 8, 32], tokens)
        save(report)
    return report


# ------------------------------------------------------------------------------------------------------------------
# what the run writes


def readme_table(report: dict) -> str:
    """The README's results table: tokens/s and the ratio to `ar` of each method, per prompt set."""
    sets = report["offline"]
    first = next(iter(sets.values()))
    names = list(first["methods"])
    header = "| method | " + " | ".join(f"{s} tok/s | vs `ar`" for s in sets) + " |"
    lines = [header, "|---|" + "---:|---:|" * len(sets)]
    for method in names:
        cells = []
        for result in sets.values():
            row = result["methods"].get(method)
            cells += [f"{row['tokens_per_s']:.1f}", f"{row['speedup_vs_ar']:.2f}x"] if row else ["", ""]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    c = report["cpu"]
    differing = [f"`{m}` ({s})" for s, result in sets.items() for m, row in result["methods"].items()
                 if row.get("outputs_equal_ar_fraction") not in (None, 1.0)]
    equal = ("every method's outputs equal `ar`'s on every prompt" if not differing
             else "outputs differ from `ar`'s for " + ", ".join(differing))
    caption = (f"{c['model']}, {c['cores']} cores ({c['kernel_path']} kernels); default model, greedy, "
               f"{first['num_prompts']} prompts of each set, {first['max_tokens']} tokens, concurrency 1; {equal}. "
               f"`python benchmarks/report.py{' --quick' if report['quick'] else ''}` wrote these figures to "
               f"`docs/results/{c['slug']}.json`.")
    notes = []
    if "retry" in report:
        retry = report["retry"]["methods"]
        notes.append(f"- Each general question asked twice in a row (a retry): `suffix` {_ratio(retry, 'suffix')}, "
                     f"`ngram` {_ratio(retry, 'ngram')} `ar`.")
    if "server" in report:
        levels = report["server"]["levels"]
        notes.append("- `specserve serve` (n-gram), concurrency " + " / ".join(map(str, levels)) + ": "
                     + " / ".join(f"{v['tokens_per_s']:.1f}" for v in levels.values()) + " tok/s.")
    return "\n".join([caption, "", *lines, "", *notes, *([""] if notes else []),
                      f"![tokens/s by method](docs/results/{c['slug']}-speed.png)"])


def _ratio(methods: dict, name: str) -> str:
    return f"{methods[name]['speedup_vs_ar']:.2f}x" if name in methods else "-"


def update_readme(table: str) -> None:
    text = README.read_text()
    if START not in text or END not in text:
        print(f"README.md has no {START} / {END} markers: its table is left as it is")
        return
    head, rest = text.split(START, 1)
    README.write_text(head + START + "\n" + table + "\n" + END + rest.split(END, 1)[1])


def charts(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slug = report["cpu"]["slug"]
    sets = report["offline"]
    names = list(next(iter(sets.values()))["methods"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(sets)
    for i, (name, result) in enumerate(sets.items()):
        values = [result["methods"].get(m, {}).get("tokens_per_s", 0) for m in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=name)
    ax.set_xticks([x + width * (len(sets) - 1) / 2 for x in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{report['cpu']['model']} ({report['cpu']['cores']} cores): greedy, concurrency 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{slug}-speed.png", dpi=110)
    plt.close(fig)

    costs = report["step_costs"]["forward_ms_by_tokens"]
    one = next(iter(costs.values()))  # a forward of one token
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot([int(k) for k in costs], [ms / one for ms in costs.values()], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in one forward")
    ax.set_ylabel("time / one token's")
    ax.set_title("the price of verifying k tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{slug}-step-costs.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes' subset")
    parser.add_argument("--rewrite", action="store_true", help="only rewrite the charts and the README's table from "
                                                               "this CPU's saved results")
    parser.add_argument("--hf", action="store_true", help="HF transformers' generate() and prompt lookup too "
                                                          "(bf16: slow on CPUs without native bf16 arithmetic)")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = cpu()
    path = RESULTS / f"{machine['slug']}.json"
    if args.rewrite:
        report = json.loads(path.read_text())
    else:
        report = run(machine, args.quick, args.hf, lambda so_far: path.write_text(json.dumps(so_far, indent=2) + "\n"))
    charts(report)
    update_readme(readme_table(report))
    print(f"wrote {path.relative_to(ROOT)} and its charts")


if __name__ == "__main__":
    main()
