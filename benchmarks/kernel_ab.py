"""Another build of the kernels (another revision's specserve/csrc) against this checkout's, in one process, builds
alternated (what such runs decided: docs/design-notes.md).

    mkdir -p /tmp/old && git archive <rev> specserve/csrc | tar -x -C /tmp/old
    python benchmarks/kernel_ab.py attention /tmp/old/specserve/csrc
    python benchmarks/kernel_ab.py forward /tmp/old/specserve/csrc --model llama-3.2-1b-q4_0.gguf
    python benchmarks/kernel_ab.py engine /tmp/old/specserve/csrc --methods ar,ngram --prompts 10
    python benchmarks/kernel_ab.py linear /tmp/old/specserve/csrc

The other csrc must have this layout (module.cpp and its variant_*.cpp, one extension); it is compiled at run
time with the flags setup.py's build gets (torch's JIT build: it needs `ninja`, `pip install ninja`). Both builds
run the variant SPECSERVE_KERNELS picks (the fastest by default).

`attention`: `decode_attention` on a few shapes (batch, query heads, rows, cached context; one kv head, or two for
8 heads, head dim 256, random masks over a causal one), outputs checked bit-identical first.
`forward`: a model's (`--model`, the default one unless given) forwards of 1, 5, 8 and 16 rows (`--rows`) after 200
cached tokens, with and without the lm_head, 8 requests of one row each, a 64-token prefill forward, the lm_head
alone at 1, 5 and 8 rows, and the greedy screen (`screen_argmax`) at 1, 8 and 64 rows of a real text's final
states; the logits of a 64-token forward checked bit-identical. The other build must read this checkout's packed
layout (same `PACK_VERSION`).
`linear`: `quant_linear` alone on one thread, a random 8192 x 768 weight of each kernel format (Q4_0, Q5_0, Q8_0, and
Q4_K, Q6_K from random GGUF blocks) at 1..8 rows: the tiles' own speed, without the model's small calls, thread wake-ups
and joins. It reports the least time of all calls: on this VM stolen time only adds, and the median moved by 20% between
builds of identical code. Outputs checked bit-identical.
`engine`: the first N general questions and N HumanEval prompts (128 tokens, greedy) through `Engine.generate` of
each method (default config), the builds alternated prompt by prompt; outputs checked equal, tokens/s per build.

Each case reports the median over `--rounds` of the median of a few timed calls; the machine's noise between runs
is larger than between the two builds of one run, which is why they alternate. The installed build and the one
compiled here can differ by a few percent on identical source (`linear` and `forward` alike): run it twice with the
builds in both roles (install the other revision, pass this one's csrc) and trust a change that shows in both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
HUMANEVAL = HERE.parent.parent / "shared" / "data" / "humaneval_question.jsonl"
ATTENTION_SHAPES = ((1, 4, 1, 200), (1, 4, 5, 200), (1, 4, 8, 1000), (8, 4, 4, 300), (2, 3, 3, 50), (1, 8, 2, 100))


def build(csrc: Path):
    """The other build: a copy of the csrc folder `csrc` compiled into one extension, with setup.py's flags."""
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    shutil.copytree(csrc, folder / "csrc")
    # setuptools puts Python's own CFLAGS (-fwrapv among them) before setup.py's; the JIT build does not, and GCC
    # compiles some loops differently with them (it dropped the K-quant tiles' prefetches under -fwrapv)
    python_flags = (sysconfig.get_config_var("CFLAGS") or "").split()
    return load(name="kernel_ab_other", sources=sorted(str(path) for path in (folder / "csrc").glob("*.cpp")),
                extra_cflags=[*python_flags, "-O3", "-g0", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder))


def use_extension(ext) -> None:
    """Make `ext` (this checkout's specserve._C or the other build) the one every kernel call goes through."""
    from specserve.models import cpu_kernels

    cpu_kernels.extension = lambda: ext
    cpu_kernels._loaded.clear()


def chosen_variant(ext):
    """The variant submodule of `ext` that SPECSERVE_KERNELS picks."""
    from specserve.models import cpu_kernels

    return getattr(ext, cpu_kernels.choose_variant(ext, cpu_kernels.mode()))


def prompts(count: int) -> list[str]:
    """The first `count` general questions, then the first `count` HumanEval prompts."""
    files = [HERE / "general_questions.jsonl", HUMANEVAL]
    return [json.loads(line)["turns"][0] for path in files for line in path.read_text().splitlines()[:count]]


def timed(run, calls: int, statistic=statistics.median) -> float:
    """`statistic` (the median, or min for the least time) of `calls` timed runs after one untimed."""
    run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistic(times)


def compare(cases: dict, use, rounds: int, calls: int) -> None:
    """cases: name -> callable; use(name) switches to build 'other' or 'this'."""
    results: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds):
        for build_name in ("other", "this") if round_ % 2 == 0 else ("this", "other"):
            use(build_name)
            for name, run in cases.items():
                results.setdefault((name, build_name), []).append(timed(run, calls))
    for name in cases:
        other, this = (statistics.median(results[(name, b)]) for b in ("other", "this"))
        print(f"{name}: other {other * 1e3:.3f} ms, this {this * 1e3:.3f} ms -> this is {other / this:.3f}x")


def attention_cases(other, this, rounds: int) -> None:
    generator = torch.Generator().manual_seed(0)
    cases = {}
    for batch, heads, rows, context in ATTENTION_SHAPES:
        keys = context + rows
        q = torch.randn(batch, heads, rows, 256, generator=generator).bfloat16()
        k = torch.randn(batch, 1 if heads <= 4 else 2, keys, 256, generator=generator).bfloat16()
        v = torch.randn(k.shape, generator=generator).bfloat16()
        causal = torch.ones(rows, keys, dtype=torch.bool).tril(diagonal=context)[None, None]
        mask = (torch.rand(batch, 1, rows, keys, generator=generator) > 0.3) & causal
        args = (q, k, v, mask, 0.0625)
        assert torch.equal(other.decode_attention(*args), this.decode_attention(*args)), "outputs differ"
        cases[f"B{batch} H{heads} T{rows} context {context}"] = args
    print("outputs bit-identical on", len(cases), "shapes")
    current = {}
    runs = {name: (lambda args=args: current["kernels"].decode_attention(*args)) for name, args in cases.items()}
    compare(runs, lambda name: current.update(kernels=other if name == "other" else this), rounds, calls=20)


def forward_cases(other, this, rounds: int, model_name: str | None, rows: tuple[int, ...] = (1, 5, 8, 16)) -> None:
    from specserve.models import quant
    from specserve.models.kernel_forward import kernel_plan
    from specserve.models.kv_cache import KVCache
    from specserve.models.loader import load_model

    loaded = load_model(model_name)
    model = loaded.model
    plan = kernel_plan(model)

    def use(name: str) -> None:
        use_extension(other if name == "other" else this)
        plan._stack = None  # the layer loop holds the kernels it was made with

    def forward(rows: int, logits: bool, context: int = 200, batch: int = 1):
        cache = KVCache.for_model(model, batch, context + rows + 1)
        positions = torch.arange(context)[None].expand(batch, -1)
        no_logits = torch.empty(batch, 0, dtype=torch.long)
        model(torch.randint(0, 1000, (batch, context)), positions, cache, positions, logits_rows=no_logits)
        cache.lengths[:] = context
        tokens = torch.zeros(batch, rows, dtype=torch.long)
        at = torch.arange(context, context + rows)[None].expand(batch, -1)
        return lambda: model(tokens, at, cache, at, logits_rows=None if logits else no_logits)

    cases = {f"forward {rows} rows{' + lm_head' if logits else ''}": forward(rows, logits)
             for rows in rows for logits in (False, True)}
    cases["forward 8 requests of 1 row"] = forward(1, False, batch=8)
    cases["prefill 64 rows"] = forward(64, False)
    for rows in (1, 5, 8):
        hidden = torch.randn(rows, model.spec.hidden_size).bfloat16()
        cases[f"lm_head {rows} rows"] = lambda hidden=hidden: model.logits(hidden, True)
    # a real text's final states: on random ones the screen would keep nearly every tile
    states = final_states(model, loaded.tokenizer, 64)

    def screen(hidden: torch.Tensor) -> torch.Tensor:
        return quant.screen_argmax(hidden, model.lm_head_packed, model.greedy_screen)

    screened = model.greedy_screen is not None  # a model whose lm_head has a greedy screen
    for rows in (1, 8, 64) if screened else ():
        start = min(20, len(states) - rows)
        cases[f"greedy screen {rows} rows"] = lambda hidden=states[start:start + rows]: screen(hidden)
    logits, choices = {}, {}
    for name in ("other", "this"):
        use(name)
        cache = KVCache.for_model(model, 1, 80)
        positions = torch.arange(64)[None]
        logits[name] = model(positions + 100, positions, cache, positions).logits
        choices[name] = screen(states) if screened else None
    assert torch.equal(logits["other"], logits["this"]), "logits differ"
    assert not screened or torch.equal(choices["other"], choices["this"]), "greedy screen answers differ"
    print("64-token logits" + (" and greedy screen answers" if screened else "") + " bit-identical")
    compare(cases, use, rounds, calls=5)
    use("this")


LINEAR_FORMATS = ((4, 32, 8, False, "Q4_0"), (5, 32, 16, False, "Q5_0"),
                  (8, 32, 128, False, "Q8_0"))  # bits, group, zero, offsets, name; the K-quants: random GGUF blocks


def linear_cases(other, this, rounds: int, rows: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)) -> None:
    import numpy as np

    from specserve.models import quant

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n, k = 8192, 768  # K a multiple of the K-quants' 256
    weights = {}
    for bits, group, zero, offsets, name in LINEAR_FORMATS:
        scales = lambda: rng.random((n, k // group), dtype=np.float32) * 0.01
        codes = quant.Codes(rng.integers(0, 2**bits, (n, k), dtype=np.uint8), scales(),
                            scales() if offsets else None, bits, group, zero, name)
        weights[name] = quant.PackedWeight.from_codes(codes)
    from random_gguf import Q, random_blocks, unit_scale  # benchmarks/random_gguf.py, beside this script

    for kind in (Q.Q4_K, Q.Q6_K):  # in their super-block layout
        raw = random_blocks(kind, n, k, rng, unit_scale(kind, k))
        weights[kind.name] = quant.PackedWeight.from_codes(quant.decode_gguf(kind.name, raw, (n, k)))
    inputs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16() for m in rows}
    for name, weight in weights.items():
        for m, x in inputs.items():
            outputs = []
            for kernels in (other, this):
                use_extension(kernels)
                outputs.append(weight.matmul(x))
            assert torch.equal(*outputs), f"{name} at {m} rows: outputs differ"
    print("outputs bit-identical")
    best: dict[tuple[str, int, str], float] = {}
    for round_ in range(rounds):
        for build_name in ("other", "this") if round_ % 2 == 0 else ("this", "other"):
            use_extension(other if build_name == "other" else this)
            for name, weight in weights.items():
                for m, x in inputs.items():
                    seconds = timed(lambda: weight.matmul(x), calls=15, statistic=min)
                    key = (name, m, build_name)
                    best[key] = min(best.get(key, seconds), seconds)
    use_extension(this)
    for name in weights:
        for m in rows:
            old, new = best[(name, m, "other")], best[(name, m, "this")]
            print(f"{name} {m} rows: other {old * 1e6:.1f} us, this {new * 1e6:.1f} us "
                  f"({m * n * k / new / 1e9:.1f} GMAC/s) -> this is {old / new:.3f}x")


def final_states(model, tokenizer, count: int) -> torch.Tensor:
    """The final normed hidden states [count, H] of the first `count` tokens of the first general questions."""
    from specserve.models.kv_cache import KVCache

    ids = torch.tensor([tokenizer.encode(" ".join(prompts(5)[:5]))[:count]])
    if ids.shape[1] < count:
        raise ValueError(f"the text has {ids.shape[1]} tokens, fewer than the {count} states asked for")
    positions = torch.arange(ids.shape[1])[None]
    cache = KVCache.for_model(model, 1, ids.shape[1])
    return model(ids, positions, cache, positions, output_layers=(-1,)).hidden_states[-1][0]


def engine_cases(other, this, methods: list[str], count: int) -> None:
    from dataclasses import replace

    from specserve.config import DeploymentConfig, build_engine
    from specserve.models.kernel_forward import kernel_plan
    from specserve.models.loader import load_model
    from specserve.speculative.sampling import SamplingParams

    target, base = load_model(), DeploymentConfig()
    questions, params = prompts(count), SamplingParams(max_tokens=128)

    def use(name: str) -> None:
        use_extension(other if name == "other" else this)
        kernel_plan(target.model)._stack = None  # the layer loop holds the kernel it was made with

    for method in methods:
        engine = build_engine(replace(base, speculative=base.speculative.with_method(method)), target)
        engine.generate(questions[0], params)
        engine.forget_requests()
        seconds, tokens, outputs = {"other": 0.0, "this": 0.0}, {"other": 0, "this": 0}, {}
        for i, prompt in enumerate(questions):
            for name in ("other", "this") if i % 2 == 0 else ("this", "other"):
                use(name)
                result = engine.generate(prompt, params)
                seconds[name] += result.metrics.total_time_s
                tokens[name] += result.metrics.output_tokens
                outputs[name, i] = result.token_ids
        equal = sum(outputs["other", i] == outputs["this", i] for i in range(len(questions)))
        other_speed, this_speed = (tokens[name] / seconds[name] for name in ("other", "this"))
        print(f"{method}: other {other_speed:.1f} tok/s, this {this_speed:.1f} -> this is "
              f"{this_speed / other_speed:.3f}x; outputs equal {equal}/{len(questions)}")
    use("this")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("attention", "forward", "linear", "engine"))
    parser.add_argument("csrc", type=Path, help="the other build's specserve/csrc folder")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--methods", default="ar,ngram", help="engine: the methods compared")
    parser.add_argument("--prompts", type=int, default=10, help="engine: prompts from each set")
    parser.add_argument("--rows", help="the row counts: linear's (default 1,2,3,4,5,6,8) or forward's (1,5,8,16)")
    parser.add_argument("--model", default=None, help="forward: a .gguf file or checkpoint (default: the embedded one)")
    args = parser.parse_args()
    from specserve.models import cpu_kernels

    other, this = build(args.csrc), cpu_kernels.extension()
    rows = {} if args.rows is None else {"rows": tuple(int(m) for m in args.rows.split(","))}  # else each kind's own
    if args.kind == "attention":
        attention_cases(chosen_variant(other), chosen_variant(this), args.rounds)
    elif args.kind == "engine":
        engine_cases(other, this, args.methods.split(","), args.prompts)
    elif args.kind == "linear":
        linear_cases(other, this, args.rounds, **rows)
    else:
        forward_cases(other, this, args.rounds, args.model, **rows)


if __name__ == "__main__":
    main()
