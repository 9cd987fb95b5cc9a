"""Self-distillation data: the target answers the training prompts, then one target forward over each prompt +
response records what every draft method learns from, streamed to disk in shards.

Per sequence: `tokens` [T] (prompt + response), `labels` [T] (the target's argmax after each position: what greedy
verification accepts), `final` [T, H] (the final normed hidden state: EAGLE-1 and Medusa features) and `aux`
[T, 3H] (the inputs of EAGLE-3's low / mid / high target layers), stored in bfloat16. A manifest (`data.json`)
names the target and settings, so a resumed or reused directory never mixes targets.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.files import write_atomically
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel
from specserve.speculative.eagle import default_aux_layer_ids
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

MANIFEST = "data.json"


@dataclass
class DataSettings:
    target: str
    num_prompts: int
    prompts_sha256: str
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    aux_layer_ids: list[int] | None = None
    shard_size: int = 32  # sequences per shard


def prompts_digest(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard_{index:05d}.pt"


def atomic_save(obj, path: Path) -> None:
    """torch.save, written aside and then renamed: an interrupted run never leaves a half-written file."""
    write_atomically(path, lambda partial: torch.save(obj, partial))


def check_manifest(directory: Path, settings, name: str = MANIFEST) -> None:
    """Write the settings (a dataclass) as the directory's manifest `name`, or ValueError naming the settings that
    differ from those it already holds: a directory is never resumed with other settings."""
    manifest = directory / name
    if manifest.exists():
        existing = json.loads(manifest.read_text())
        if existing != asdict(settings):
            differing = sorted(k for k in existing.keys() | asdict(settings).keys()
                               if existing.get(k) != asdict(settings).get(k))
            raise ValueError(f"{directory} holds data made with other settings ({', '.join(differing)}); "
                             f"use another directory or the same target, prompts and settings")
    else:
        directory.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps(asdict(settings), indent=2))


def build_dataset(target: LoadedModel, prompts: list[str], directory, max_tokens: int = 128,
                  temperature: float = 0.0, seed: int = 0, batch_size: int = 8, shard_size: int = 32) -> Path:
    """Generate and record the whole set (resumable: finished shards are kept). Returns the directory."""
    if not prompts:
        raise ValueError("no training prompts")
    directory = Path(directory)
    spec = target.model.spec
    settings = DataSettings(target=str(target.path), num_prompts=len(prompts), prompts_sha256=prompts_digest(prompts),
                            max_tokens=max_tokens, temperature=temperature, seed=seed,
                            aux_layer_ids=default_aux_layer_ids(spec.num_layers), shard_size=shard_size)
    check_manifest(directory, settings)
    num_shards = -(-len(prompts) // shard_size)
    # prompt lookup makes the responses faster to produce and changes nothing in them (lossless)
    engine = Engine(target, NGramMethod(1, 3), 4, max_model_len=target.max_model_len)
    todo = [i for i in range(num_shards) if not shard_path(directory, i).exists()]
    for index in tqdm(todo, desc="self-distillation data", unit="shard"):
        chunk = prompts[index * shard_size: (index + 1) * shard_size]
        sequences = generate(engine, chunk, max_tokens, temperature, seed + index * shard_size, batch_size)
        records = [record_features(target, seq, settings.aux_layer_ids) for seq in sequences]
        atomic_save(records, shard_path(directory, index))
    return directory


def generate(engine: Engine, prompts: list[str], max_tokens: int, temperature: float, seed: int,
             batch_size: int) -> list[list[int]]:
    """prompt + response token ids for each prompt, decoded in continuous batches."""
    return [ids for ids, _ in decode_batches(engine, prompts, max_tokens, batch_size, temperature, seed)]


def decode_batches(engine: Engine, prompts: list[str], max_tokens: int, batch_size: int, temperature: float = 0.0,
                   seed: int = 0) -> list[tuple[list[int], object]]:
    """(prompt + response token ids, the finished sequence) for each prompt, decoded in continuous batches."""
    batch = BatchEngine(engine, max_batch_size=batch_size, adaptive_draft=False)
    owners, results = {}, {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        owners[id(batch.add(prompt, params))] = (i, engine.encode(prompt))
    while batch.has_work():
        for seq, event in batch.step():
            if isinstance(event, Exception):
                raise event
            if event.result is not None:
                index, prompt_ids = owners[id(seq)]
                results[index] = (prompt_ids + event.result.token_ids, seq)
    return [results[i] for i in range(len(prompts))]


@torch.inference_mode()
def record_features(target: LoadedModel, tokens: list[int], aux_layer_ids: list[int], labels: bool = True) -> dict:
    """`labels=False`: the features alone (no lm_head over every position: most of a small model's forward)."""
    model = target.model
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    cache = KVCache.for_model(model, 1, len(tokens))
    layers = tuple(i - 1 for i in aux_layer_ids)
    out = model(ids, positions, cache, positions, output_layers=(-1, *layers),
                logits_rows=None if labels else torch.empty(1, 0, dtype=torch.long))
    return {"tokens": ids[0].clone(), "labels": out.logits[0].argmax(-1) if labels else None,
            "final": out.hidden_states[-1][0].to(torch.bfloat16).clone(),
            "aux": torch.cat([out.hidden_states[i][0] for i in layers], -1).to(torch.bfloat16)}


def load_dataset(directory) -> tuple[DataSettings, list[dict]]:
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: not a specserve training data directory")
    settings = DataSettings(**json.loads(manifest.read_text()))
    records = []
    for index in range(-(-settings.num_prompts // settings.shard_size)):
        path = shard_path(directory, index)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the data was not finished (run again to resume)")
        records.extend(torch.load(path, weights_only=True))
    return settings, records
