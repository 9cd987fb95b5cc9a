"""Methods with the draft gate held open, held shut or left alone, alternated with each other in one process.

    python benchmarks/draft_gate_ab.py --dataset ../shared/data/humaneval_question.jsonl --num-prompts 6 \
        --gate shut --methods ar,eagle,eagle3 --passes 2
    python benchmarks/draft_gate_ab.py --dataset benchmarks/general_questions.jsonl --num-prompts 6 \
        --gate open --methods ar,eagle3 --max-draft-len 1

`--gate open` prices what drafting every step costs and gives (the head's own speed); `shut` what a head costs
while its gate keeps it off (it should match `ar`); `on` is the default behaviour. Each pass runs every method over
the same prompts before the next pass starts, so drift on a shared VM shows up as the spread between passes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.bench.offline import load_prompts, run_bench
from specserve.cli import deployment_config
from specserve.speculative.policy import draft_gate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--methods", default="ar,eagle3")
    parser.add_argument("--gate", choices=("on", "open", "shut"), default="on")
    parser.add_argument("--max-draft-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=1)
    args = parser.parse_args()
    if args.gate != "on":
        held = args.gate == "open"
        draft_gate.DraftGate.decide = lambda self, verify_seconds: held
    config = deployment_config(None, None, None, args.max_draft_len, None, None, None, None)
    target = config.model.load()
    prompts = load_prompts(args.dataset, args.num_prompts)
    print(f"{'pass':>4} {'method':<14} {'tok/s':>8} {'tau':>6} {'step ms':>8} {'draft ms':>9}")
    for number in range(1, args.passes + 1):
        for method in args.methods.split(","):
            run = run_bench(config, target, prompts, [method], args.max_tokens)[method]
            print(f"{number:>4} {method:<14} {run['tokens_per_s']:>8.1f} {run['acceptance_length']:>6.2f} "
                  f"{run['step_ms']:>8.2f} {run['draft_ms_per_step']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
