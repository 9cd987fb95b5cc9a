"""Training a head on an accelerator within a time budget: `python -m specserve.train.accelerated`.

The CPU path (`specserve train --distilled`) recomputes a shard's missing features with one forward of specserve's
own model per sequence, ~190 tokens/s on two cores: hours for a few million tokens, before training at seconds a
step. Here the features come from transformers' implementation of the target on the accelerator, in length-sorted
batches padded on the right (padding after a sequence's last token changes none of its causal features):

    aux   = the residual stream entering each of EAGLE-3's fused layers (transformers' hidden_states[i] is the
            input of layer i), concatenated
    final = the final normed hidden state (EAGLE-1, Medusa)

The weights are the GGUF's, dequantized by transformers' GGUF reader; the labels are the token data's own (the
served target's greedy responses), as on the CPU path. Training is `heads.train` with the settings given; its step
count is fitted to the time left after the features, from a timed probe of a few steps, so the cosine schedule
ends when the time does. The head is written in its published layout, as `specserve train` writes it; evaluate it
on the served target with `specserve.train.run.evaluate`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from specserve.models import gguf_file
from specserve.models.gguf_convert import dequantized_gguf, gguf_config
from specserve.models.loader import LoadedModel, build_model
from specserve.speculative.eagle import default_aux_layer_ids
from specserve.train.distill import load_token_data, training_record
from specserve.train.heads import TrainSettings, train

PROBE_STEPS = 20
WRITING_SECONDS = 30.0  # the head's file, the history, the report


def transformers_model(config, tensors: dict, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, _ = model.load_state_dict(tensors, strict=False)
    if [name for name in missing if name != "lm_head.weight"]:
        raise ValueError(f"the GGUF's tensors miss {missing[:5]}")
    return model.to(device).eval()


@torch.inference_mode()
def batched_features(model, sequences: list[list[int]], aux_layer_ids: list[int], device: torch.device,
                     tokens_per_batch: int = 32768) -> list[torch.Tensor]:
    """Per sequence, the features (aux | final) of every token but the last, bfloat16 on the CPU."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        end = start + 1  # as many sequences as fit in tokens_per_batch at the longest one's (the last) length
        while end < len(order) and (end - start + 1) * (len(sequences[order[end]]) - 1) <= tokens_per_batch:
            end += 1
        chunk = order[start:end]
        longest = len(sequences[chunk[-1]]) - 1
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for row, index in enumerate(chunk):
            seq = sequences[index][:-1]
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
        result = model.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        features = torch.cat([*(result.hidden_states[i] for i in aux_layer_ids), result.last_hidden_state], -1)
        features = features.to(torch.bfloat16).cpu()
        for row, index in enumerate(chunk):
            out[index] = features[row, : len(sequences[index]) - 1].clone()
        start = end
    return out


def records_of(directories: list[Path], model, aux_layer_ids: list[int], device: torch.device,
               tokens_per_batch: int = 32768) -> list[dict]:
    """`heads.train`'s records from token data directories (as `distill.load_distilled` makes them)."""
    sequences = [seq for directory in directories for seq in load_token_data(directory)]
    features = batched_features(model, [seq["ids"] for seq in sequences], aux_layer_ids, device, tokens_per_batch)
    return [training_record(seq, feature) for seq, feature in zip(sequences, features)]


def fitted_steps(settings: TrainSettings, target: LoadedModel, records: list[dict], seconds_left: float,
                 scratch: Path, at_most: int) -> tuple[int, float]:
    """Steps that fit in `seconds_left`, and the seconds a step: the difference between runs of 1 and
    1 + PROBE_STEPS steps (a run's setup and writing cancel out), after one untimed run that warms the device."""
    def timed(steps: int, name: str) -> float:
        probe = TrainSettings(**{**settings.__dict__, "steps": steps, "save_every": 10 ** 9})
        started = time.perf_counter()
        train(probe, target, records, scratch / name, progress=False)
        return time.perf_counter() - started

    timed(1, "warm")
    per_step = max(timed(1 + PROBE_STEPS, "long") - timed(1, "short"), 1e-3) / PROBE_STEPS
    return max(1, min(at_most, int(seconds_left / per_step))), per_step


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the target, as it is served")
    parser.add_argument("--distilled", type=Path, action="append", required=True,
                        help="`specserve distill` token data (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", default="eagle3", choices=["eagle3", "eagle", "medusa", "dflash"])
    parser.add_argument("--minutes", type=float, required=True, help="wall time for the whole run")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--medusa-heads", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=2, help="dflash: the block drafter's layers")
    parser.add_argument("--block-size", type=int, default=8, help="dflash: the block")
    parser.add_argument("--anchors", type=int, default=16, help="dflash: blocks drawn per window")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    deadline = time.perf_counter() + 60 * args.minutes
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with gguf_file.shared_readers():
        config = gguf_config(args.gguf)
        tensors = dequantized_gguf(args.gguf, config)
    dense = build_model(config, tensors, torch.float32)  # the embedding and lm_head the trainers read
    target = LoadedModel(args.gguf.stem, args.gguf, dense, None, set(), 4096)
    aux = default_aux_layer_ids(dense.spec.num_layers)
    started = time.perf_counter()
    model = transformers_model(config, tensors, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    records = records_of(args.distilled, model, aux, device)
    del model
    features_seconds = time.perf_counter() - started
    settings = TrainSettings(kind=args.kind, lr=args.lr, batch_size=args.batch_size, ttt_steps=args.ttt_steps,
                             draft_vocab_size=args.draft_vocab_size, medusa_heads=args.medusa_heads, seed=args.seed,
                             draft_layers=args.draft_layers, block_size=args.block_size, anchors=args.anchors,
                             save_every=500, vocab_rows_only=args.kind == "medusa")
    steps, per_step = fitted_steps(settings, target, records, deadline - time.perf_counter() - WRITING_SECONDS,
                                   args.out / "probe", args.max_steps)
    shutil.rmtree(args.out / "probe")
    settings.steps = steps
    started = time.perf_counter()
    train(settings, target, records, args.out, aux_layer_ids=aux)
    report = {"kind": args.kind, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "train_sequences": len(records), "train_tokens": sum(r["tokens"].numel() + 1 for r in records),
              "features_seconds": round(features_seconds, 1), "probe_seconds_per_step": round(per_step, 4),
              "train_seconds": round(time.perf_counter() - started, 1), "settings": settings.__dict__}
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
