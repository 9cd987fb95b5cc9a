"""`specserve train`: prompts -> self-distillation data -> a trained head -> held-out acceptance evaluation."""

from __future__ import annotations

import json
import time
from pathlib import Path

from specserve.config import DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.models.loader import LoadedModel
from specserve.speculative import registry
from specserve.speculative.sampling import SamplingParams
from specserve.train.data import build_dataset, load_dataset
from specserve.train.heads import TrainSettings, train
from specserve.speculative.eagle import default_aux_layer_ids
from specserve.train.prompt_files import check_held_out

def split_held_out(prompts: list[str], fraction: float = 0.05, at_most: int = 20) -> tuple[list[str], list[str]]:
    """Training prompts and held-out evaluation prompts (the last few: the set is shuffled when built)."""
    count = min(at_most, max(1, int(len(prompts) * fraction))) if len(prompts) > 1 else 0
    return prompts[: len(prompts) - count], prompts[len(prompts) - count:]


def evaluate(target: LoadedModel, kind: str, head_dir, prompts: list[str], max_tokens: int = 128,
             max_draft_len: int = 6) -> dict:
    """Greedy decoding with the trained head on held-out prompts: tau, acceptance per draft position, and
    whether the output equals plain decoding (it must)."""
    method = registry.for_training(kind).name
    spec = SpeculativeConfig(method, max_draft_len, str(head_dir), adaptive_draft_len=False)
    engine = build_engine(DeploymentConfig(ModelConfig(str(target.path)), speculative=spec), target)
    plain = build_engine(DeploymentConfig(ModelConfig(str(target.path))), target)
    params = SamplingParams(max_tokens=max_tokens)
    output = forwards = 0
    drafted: list[int] = []
    accepted: list[int] = []
    equal = 0
    for prompt in prompts:
        result = engine.generate(prompt, params)
        m = result.metrics
        output += m.output_tokens
        forwards += m.target_forwards
        for i, (d, a) in enumerate(zip(m.drafts_per_position, m.accepted_per_position)):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
        equal += result.token_ids == plain.generate(prompt, params).token_ids
    return {"prompts": len(prompts), "tau": output / max(forwards, 1),
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
            "outputs_equal_plain": equal, "method": method, "max_draft_len": max_draft_len}


def run_training(target: LoadedModel, kind: str, prompts: list[str], out_dir, data_dir=None,
                 eval_prompts: list[str] | None = None, max_tokens: int = 128, temperature: float = 0.0,
                 settings: TrainSettings | None = None, echo=print) -> dict:
    out_dir = Path(out_dir)
    data_dir = Path(data_dir) if data_dir else out_dir / "data"
    if eval_prompts is None:
        prompts, eval_prompts = split_held_out(prompts)
    check_held_out(prompts, eval_prompts)
    settings = settings or TrainSettings(kind=kind)
    start = time.perf_counter()
    build_dataset(target, prompts, data_dir, max_tokens=max_tokens, temperature=temperature, seed=settings.seed)
    data_seconds = time.perf_counter() - start
    data, records = load_dataset(data_dir)
    start = time.perf_counter()
    train(settings, target, records, out_dir, aux_layer_ids=data.aux_layer_ids)
    train_seconds = time.perf_counter() - start
    report = {"kind": kind, "target": str(target.path), "train_prompts": len(prompts),
              "train_tokens": sum(r["tokens"].numel() for r in records), "data_seconds": round(data_seconds, 1),
              "train_seconds": round(train_seconds, 1), "settings": settings.__dict__}
    return finish_report(report, target, kind, out_dir, eval_prompts, max_tokens, echo)


def finish_report(report: dict, target: LoadedModel, kind: str, out_dir: Path, eval_prompts: list[str],
                  max_tokens: int, echo) -> dict:
    """The held-out evaluation (when there are prompts) added to the report, which is written beside the head."""
    if eval_prompts:
        report["eval"] = evaluate(target, kind, out_dir, eval_prompts, max_tokens)
        e = report["eval"]
        echo(f"held-out: tau {e['tau']:.2f} on {e['prompts']} prompts; acceptance by position "
             + " ".join(f"{a:.2f}" for a in e["acceptance_per_position"]))
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2))
    return report


def train_distilled(dense: LoadedModel, served: LoadedModel, kind: str, distilled_dirs: list, feature_dirs: list,
                    out_dir, eval_prompts: list[str], settings: TrainSettings, max_tokens: int = 128,
                    echo=print) -> dict:
    """Train on token data made by `specserve distill` (one or more directories, each with its features
    directory; features recomputed on `served` where missing), then evaluate on the held-out prompts with the
    model the head will serve with."""
    from specserve.train.distill import load_distilled

    if len(distilled_dirs) != len(feature_dirs):
        raise ValueError(f"{len(distilled_dirs)} token data directories but {len(feature_dirs)} feature "
                         f"directories: give one --features per --distilled, in the same order")
    out_dir = Path(out_dir)
    start = time.perf_counter()
    records = [record for tokens, features in zip(distilled_dirs, feature_dirs)
               for record in load_distilled(tokens, features, served)]
    echo(f"{len(records)} sequences, {sum(r['tokens'].numel() for r in records)} positions")
    train(settings, dense, records, out_dir, aux_layer_ids=default_aux_layer_ids(dense.model.spec.num_layers))
    report = {"kind": kind, "target": str(served.path), "train_sequences": len(records),
              "train_tokens": sum(r["tokens"].numel() + 1 for r in records),
              "train_seconds": round(time.perf_counter() - start, 1), "settings": settings.__dict__}
    return finish_report(report, served, kind, out_dir, eval_prompts, max_tokens, echo)
