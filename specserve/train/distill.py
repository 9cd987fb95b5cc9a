"""Self-distillation token data: the target's own greedy responses to the training prompts, kept as token ids.

Token ids are all a head's training needs to keep: one target forward over prompt + response recomputes the
features (`data.record_features`), so the ids (a few MB for a million tokens) live in the repository while the
features (kilobytes per token) stay where training runs. The generating run records them on the way
(`FeatureRecorder`: the forwards that decode the responses compute them anyway), from the quantized kernels the
target serves with, so a head trains on exactly the features it drafts from.

Layout of a directory: `manifest.json` (target, response length, temperature) and `tokens_NNNNN.json`, one per
shard of `shard_size` prompts: the prompts' digest and, per prompt, its token count and prompt + response ids.
A run resumes at the first missing shard; a shard whose prompts differ from the run's is an error, never reused.
`prompts.jsonl` keeps the run's whole prompt list, so a run resumed elsewhere (where the standard library that
the code prompts come from may differ) continues the same list.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.engine import Engine
from specserve.models.chat_template import chat_texts
from specserve.files import write_atomically
from specserve.models.loader import LoadedModel
from specserve.speculative.base import Proposal, Proposer, SpecMethod
from specserve.speculative.eagle import default_aux_layer_ids
from specserve.train.data import atomic_save, check_manifest, decode_batches, prompts_digest
from specserve.train.prompt_files import read_prompt_file, write_prompts

MANIFEST = "manifest.json"
PROMPTS = "prompts.jsonl"


@dataclass
class DistillSettings:
    target: str  # the model's name: a directory made with one target is never resumed with another
    max_tokens: int = 128
    temperature: float = 0.0
    shard_size: int = 64
    chat: bool = False  # each prompt asked as a user's message through the target's chat template


def shard_file(directory: Path, index: int) -> Path:
    return directory / f"tokens_{index:05d}.json"


def feature_file(directory: Path, index: int) -> Path:
    return directory / f"features_{index:05d}.pt"


class FeatureRecorder(SpecMethod):
    """A method that drafts nothing and keeps the target's features of every token it commits: EAGLE-3's fused
    layer inputs, then the final normed state (EAGLE-1, Medusa)."""

    name = "record"
    needs_hidden_states = True

    def __init__(self, num_layers: int):
        self.aux_layer_ids = default_aux_layer_ids(num_layers)
        self.hidden_layers = (*(i - 1 for i in self.aux_layer_ids), -1)  # the input of layer i: layer i-1's output

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return FeatureKeeper()


class FeatureKeeper(Proposer):
    def __init__(self):
        self.features: list[torch.Tensor] = []

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        return Proposal.chain(tokens[-1], [])

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.features.append(hidden.to(torch.bfloat16))


def generate_recording(engine: Engine, prompts: list[str], max_tokens: int, batch_size: int
                       ) -> list[tuple[list[int], torch.Tensor]]:
    """prompt + response ids and the features of every token but the last (the one never fed), per prompt."""
    return [(ids, torch.cat(seq.proposer.features))
            for ids, seq in decode_batches(engine, prompts, max_tokens, batch_size)]


def read_shard(path: Path, prompts: list[str] | None = None) -> list[dict]:
    shard = json.loads(path.read_text())
    if prompts is not None and shard["prompts_sha256"] != prompts_digest(prompts):
        raise ValueError(f"{path} was made from other prompts than this run's shard: use another directory")
    return shard["sequences"]


def distill_tokens(target: LoadedModel, name: str, prompts: list[str], directory, feature_dir=None,
                   max_tokens: int = 128, batch_size: int = 16, shard_size: int = 64, chat: bool = False) -> dict:
    """Generate every shard not yet on disk (greedy, continuous batches of `batch_size`; no drafting: a batch
    of 16 rows is compute-bound, where drafts cost more than they save). With `chat`, each prompt is asked as a
    user's message through the target's chat template (the ids /v1/chat/completions makes of it): the data of a
    head that drafts for chat. Returns token counts and seconds."""
    directory = Path(directory)
    settings = DistillSettings(target=name, max_tokens=max_tokens, shard_size=shard_size, chat=chat)
    check_manifest(directory, settings, MANIFEST)
    if not (directory / PROMPTS).exists():
        write_prompts(directory / PROMPTS, prompts)
    engine = Engine(target, FeatureRecorder(target.model.spec.num_layers), 1, max_model_len=target.max_model_len)
    feature_dir = Path(feature_dir) if feature_dir else directory
    feature_dir.mkdir(parents=True, exist_ok=True)
    shards = [prompts[i: i + shard_size] for i in range(0, len(prompts), shard_size)]
    done = {i for i in range(len(shards)) if shard_file(directory, i).exists()}
    for i in done:
        read_shard(shard_file(directory, i), shards[i])
    new_tokens, start = 0, time.perf_counter()
    bar = tqdm(total=len(prompts), initial=sum(len(shards[i]) for i in done), desc="self-distillation",
               unit="prompt")
    for index, chunk in enumerate(shards):
        if index in done:
            continue
        texts = chat_texts(target.tokenizer, chunk) if chat else chunk
        recorded = generate_recording(engine, texts, max_tokens, batch_size)
        sequences = [ids for ids, _ in recorded]
        lengths = [len(engine.encode(text)) for text in texts]
        atomic_save([features for _, features in recorded], feature_file(feature_dir, index))
        body = {"prompts_sha256": prompts_digest(chunk),
                "sequences": [{"prompt_tokens": n, "ids": ids} for n, ids in zip(lengths, sequences)]}
        write_atomically(shard_file(directory, index), lambda partial: Path(partial).write_text(json.dumps(body)))
        new_tokens += sum(len(ids) - n for n, ids in zip(lengths, sequences))
        bar.update(len(chunk))
        bar.set_postfix(response_tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    return {"shards": len(shards), "new_response_tokens": new_tokens,
            "seconds": round(time.perf_counter() - start, 1)}


def saved_prompts(directory) -> list[str] | None:
    """The prompt list of an earlier run in `directory`, if any (a resumed run continues it)."""
    path = Path(directory) / PROMPTS
    return read_prompt_file(path) if path.exists() else None


def unseen_prompts(prompts: list[str], earlier_dirs) -> list[str]:
    """`prompts` less those an earlier run in any of `earlier_dirs` was given: a new directory of more data."""
    seen: set[str] = set()
    for directory in earlier_dirs:
        saved = saved_prompts(directory)
        if saved is None:
            raise FileNotFoundError(f"{directory} has no {PROMPTS}: not a specserve token data directory")
        seen.update(saved)
    return [p for p in prompts if p not in seen]


def load_token_data(directory) -> list[dict]:
    """Every finished shard's sequences, in shard order (a partial run gives what it has)."""
    directory = Path(directory)
    if not (directory / MANIFEST).exists():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: not a specserve token data directory")
    sequences = []
    for path in sorted(directory.glob("tokens_*.json")):
        sequences.extend(read_shard(path))
    return sequences


def load_distilled(directory, feature_dir, target: LoadedModel | None = None) -> list[dict]:
    """Training records (`heads.train`'s) from token data and its features: per sequence the tokens and
    features of every position but the last, labels = the next token (greedy: the target's argmax over the
    response), and `loss_from`, the first position whose label is a response token (the prompt's own text is not
    what the target would say). A shard whose features are missing is recomputed with one target forward per
    sequence (`target` needed then)."""
    directory, feature_dir = Path(directory), Path(feature_dir)
    settings = DistillSettings(**json.loads((directory / MANIFEST).read_text()))
    records = []
    for path in sorted(directory.glob("tokens_*.json")):
        sequences = read_shard(path)
        features_path = feature_dir / path.name.replace("tokens_", "features_").replace(".json", ".pt")
        if features_path.exists():
            features = torch.load(features_path, weights_only=True)
        else:
            if target is None:
                raise FileNotFoundError(f"{features_path} is missing: give the target to recompute it")
            features = [recompute_features(target, seq["ids"]) for seq in sequences]
            feature_dir.mkdir(parents=True, exist_ok=True)
            atomic_save(features, features_path)
        records.extend(training_record(seq, feature) for seq, feature in zip(sequences, features))
    if not records:
        raise FileNotFoundError(f"{directory} holds no token shards yet (settings: {settings})")
    return records


def training_record(seq: dict, feature: torch.Tensor) -> dict:
    """One sequence of token data and its features (EAGLE-3's three fused layers, then the final state) as a
    `heads.train` record."""
    ids = torch.tensor(seq["ids"])
    hidden = feature.shape[-1] // 4
    return {"tokens": ids[:-1], "labels": ids[1:], "aux": feature[:, : 3 * hidden], "final": feature[:, 3 * hidden:],
            "loss_from": seq["prompt_tokens"] - 1}


@torch.inference_mode()
def recompute_features(target: LoadedModel, ids: list[int]) -> torch.Tensor:
    """What `FeatureRecorder` keeps for a sequence, from one forward over all but its last token."""
    from specserve.train.data import record_features

    record = record_features(target, ids[:-1], default_aux_layer_ids(target.model.spec.num_layers), labels=False)
    return torch.cat([record["aux"], record["final"]], -1)
