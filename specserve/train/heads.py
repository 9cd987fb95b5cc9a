"""Training EAGLE-1, EAGLE-3 and Medusa heads on a frozen target from self-distillation data (`data.py`).

EAGLE heads train with a training-time test (EAGLE-3): step 0 reads the target's features; step j reads the
head's own outputs of step j - 1 at the same position, with the tokens j further on, and its attention sees the
real pairs causally plus its own earlier steps at that position only: exactly what a tree node at depth j + 1
sees when drafting. The step-j output at position t predicts token t + 2 + j, labelled with the target's argmax.
EAGLE-3 learns by cross-entropy over its draft vocabulary (chosen from the data's token frequencies); EAGLE-1 by
cross-entropy through the target's lm_head plus regression onto the target's next feature (EAGLE's losses), the
cross-entropy over the lm_head rows of its draft vocabulary where it has one: the rows it is scored by at inference
(a 262k-row lm_head over every window position would be most of a step's time on a CPU).
Medusa head i reads the target's final feature at t and predicts token t + 2 + i. A DFlash block drafter learns
to fill blocks after anchors drawn in each window (`blocks.py`).

Runs are deterministic given the seed (the windows of step s come from a generator seeded by (seed, s)) and
resumable bit-exactly from the checkpoint written every `save_every` steps.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.models.loader import LoadedModel
from specserve.models.transformer import soft_cap
from specserve.speculative.dflash import new_dflash, save_dflash
from specserve.speculative.eagle import EagleHead, new_eagle_head, save_eagle
from specserve.speculative.medusa import MedusaHeads, save_medusa
from specserve.speculative.weights import write_draft_vocab
from specserve.train.blocks import block_loss
from specserve.train.data import atomic_save
from specserve.train.draft import draft_loss, new_draft_model, save_draft_model
from specserve.train.vocab import pick_draft_vocab, subset_labels

CHECKPOINT = "checkpoint.pt"
STEP_WEIGHT = 0.8  # EAGLE-3's decay of the loss weight per training-time-test step


@dataclass
class TrainSettings:
    kind: str  # eagle | eagle3 | medusa | draft | dflash
    steps: int = 1000
    lr: float = 3e-4
    warmup: int = 50
    batch_size: int = 4  # windows per micro-batch
    grad_accum: int = 1
    seq_len: int = 256
    ttt_steps: int = 3  # EAGLE: drafting steps simulated per window
    draft_vocab_size: int = 16384  # the most frequent tokens scored (the vocabulary if more); EAGLE-1 at inference
    medusa_heads: int = 4
    vocab_rows_only: bool = False  # Medusa: write only the draft vocabulary's lm_head rows (the compact form)
    draft_layers: int = 2  # draft: decoder layers kept; dflash: the drafter's layers
    block_size: int = 8  # dflash: the block (its first token and block_size - 1 drafted)
    anchors: int = 16  # dflash: blocks drawn per window
    seed: int = 0
    save_every: int = 100
    weight_decay: float = 0.0


def sample_windows(records: list[dict], settings: TrainSettings, step: int, micro: int) -> dict:
    """A micro-batch of windows [B, L] (shorter sequences padded; `valid` marks real positions)."""
    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + step * 131 + micro)
    length = settings.seq_len
    batch = {"tokens": [], "labels": [], "final": [], "aux": [], "valid": []}
    for _ in range(settings.batch_size):
        r = records[int(torch.randint(len(records), (1,), generator=g))]
        total = r["tokens"].numel()
        start = int(torch.randint(max(total - length, 0) + 1, (1,), generator=g))
        end = min(start + length, total)
        pad = length - (end - start)
        for key in ("tokens", "labels", "final", "aux"):
            part = r[key][start:end]
            batch[key].append(F.pad(part, (0, 0, 0, pad) if part.dim() == 2 else (0, pad)))
        valid = torch.arange(length) < end - start
        if "loss_from" in r:  # labels before it are not the target's own (distilled data: the prompt's text)
            valid &= torch.arange(start, start + length) >= r["loss_from"]
        batch["valid"].append(valid)
    return {k: torch.stack(v) for k, v in batch.items()}


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, t + by] at t (filled past the end)."""
    if by == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, by]
    return F.pad(x[:, by:], pad, value=fill)


def eagle_step_outputs(head: EagleHead, embed_table: torch.Tensor, batch: dict, steps: int) -> list[torch.Tensor]:
    """The head's outputs [B, T, h] for training-time-test steps 0..steps-1."""
    tokens = batch["tokens"]
    features = batch["aux"] if head.kind == "eagle3" else batch["final"]
    x_prev = features.to(head.fc.weight.dtype)
    pasts = [[] for _ in head.decoder_layers]
    outputs = []
    t = tokens.shape[1]
    for j in range(steps):
        embeds = F.embedding(shifted(tokens, 1 + j), embed_table).to(x_prev.dtype)
        cos, sin = (c.to(x_prev.device) for c in head.rotary(torch.arange(t) + j))
        if head.kind == "eagle3":
            x = head.fc(x_prev) if j == 0 else x_prev
        else:
            x = head.fc(torch.cat([embeds, x_prev], -1))
        for layer, past in zip(head.decoder_layers, pasts):
            x = layer.over_steps(x, embeds, cos.to(x.dtype), sin.to(x.dtype), past)
        outputs.append(x)
        x_prev = x
    return outputs


class FrozenTarget:
    """What the EAGLE losses read from the target (embedding table, lm_head), on the training device. With
    `vocab` (sorted target ids), logits are over those rows of the lm_head only."""

    def __init__(self, target: LoadedModel, device: torch.device, vocab: torch.Tensor | None = None):
        model = target.model
        self.embed_table = model.model.embed_tokens.weight.to(device)
        weight = model.lm_head_weight
        self.vocab = None if vocab is None or vocab.numel() >= weight.shape[0] else vocab.to(device)
        self.lm_head_weight = (weight if self.vocab is None else weight[vocab]).to(device)
        self.vocab_size = weight.shape[0]
        self.softcap = model.spec.final_logit_softcapping

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(F.linear(hidden, self.lm_head_weight.to(hidden.dtype)).float(), self.softcap)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids as positions in the logits' rows (-100, ignored, outside the vocabulary)."""
        return labels if self.vocab is None else subset_labels(labels, self.vocab, self.vocab_size)


def eagle_loss(head: EagleHead, target: FrozenTarget, batch: dict, steps: int) -> tuple[torch.Tensor, float]:
    """Weighted loss over the training-time-test steps, and the step-0 top-1 accuracy."""
    outputs = eagle_step_outputs(head, target.embed_table, batch, steps)
    total, accuracy = 0.0, 0.0
    for j, out in enumerate(outputs):
        labels = shifted(batch["labels"], 1 + j, fill=0)
        valid = shifted(batch["valid"], 1 + j, fill=False)
        if head.kind == "eagle3":
            labels = subset_labels(labels, head.draft_to_target(), head.config.vocab_size)
            logits = head.lm_head(head.norm(out)).float()
            loss = F.cross_entropy(logits[valid], labels[valid], ignore_index=-100)
        else:
            logits, labels = target.logits(out), target.labels(labels)
            feature = shifted(batch["final"], 1 + j).to(out.dtype)
            regression = F.smooth_l1_loss(out[valid].float(), feature[valid].float())
            loss = 0.1 * F.cross_entropy(logits[valid], labels[valid], ignore_index=-100) + regression
        total = total + STEP_WEIGHT ** j * loss
        if j == 0:
            accuracy = float((logits[valid].argmax(-1) == labels[valid]).float().mean())
    return total, accuracy


def medusa_loss(heads: MedusaHeads, batch: dict) -> tuple[torch.Tensor, float]:
    """Head i at position t: cross-entropy against token t + 2 + i, over the draft vocabulary."""
    vocab = heads.train_vocab.to(batch["labels"].device)
    hidden = batch["final"].to(heads.heads[0][-1].weight.dtype)
    total, accuracy = 0.0, 0.0
    for i, (head, rows) in enumerate(zip(heads.heads, heads.vocab_rows)):
        logits = F.linear(head[:-1](hidden), rows).float()
        labels = subset_labels(shifted(batch["labels"], 1 + i, fill=0), vocab, heads.vocab_size)
        valid = shifted(batch["valid"], 1 + i, fill=False) & (labels >= 0)
        loss = F.cross_entropy(logits[valid], labels[valid])
        total = total + STEP_WEIGHT ** i * loss
        if i == 0:
            accuracy = float((logits[valid].argmax(-1) == labels[valid]).float().mean())
    return total, accuracy


def new_medusa(target: LoadedModel, num_heads: int) -> MedusaHeads:
    """Medusa's initialization: residual blocks at zero (identity), each lm_head a copy of the target's."""
    spec = target.model.spec
    heads = MedusaHeads(spec.hidden_size, spec.vocab_size, num_heads, 1, str(target.path))
    with torch.no_grad():
        for head in heads.heads:
            for block in head[:-1]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            head[-1].weight.copy_(target.model.lm_head_weight.float())
    return heads


def training_device() -> torch.device:
    """A GPU when there is one (training is the same code there), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16, AMX): elsewhere bf16 autocast emulates it, tens of
    times slower than float32 (a training step took 97 s instead of ~2 on an AVX2-only CPU)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def learning_rate(settings: TrainSettings, step: int) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(settings.steps - settings.warmup, 1)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def build_module(settings: TrainSettings, target: LoadedModel, records: list[dict], aux_layer_ids):
    spec = target.model.spec
    vocab = pick_draft_vocab(records, spec.vocab_size, settings.draft_vocab_size)
    if settings.kind in ("medusa", "draft"):
        module = new_medusa(target, settings.medusa_heads) if settings.kind == "medusa" \
            else new_draft_model(target, settings.draft_layers)
        module.train_vocab = vocab  # scored in training and at inference (draft_vocab.json)
        if settings.kind == "medusa":  # train only the draft vocabulary's lm_head rows: AdamW over 3 x 262k rows
            for head in module.heads:  # would cost seconds a step
                head[-1].weight.requires_grad_(False)
            module.vocab_rows = torch.nn.ParameterList(
                torch.nn.Parameter(head[-1].weight.detach()[vocab].clone()) for head in module.heads)
        return module
    if settings.kind == "dflash":  # scored through those rows of the target's lm_head (draft_vocab.json)
        module = new_dflash(spec, settings.draft_layers, settings.block_size, mask_token_id(target),
                            target.model.embed_scale or 1.0, [i - 1 for i in aux_layer_ids] if aux_layer_ids else None,
                            seed=settings.seed)
        module.train_vocab = vocab
        return module
    head = new_eagle_head(spec, settings.kind, draft_vocab_ids=vocab if settings.kind == "eagle3" else None,
                          seed=settings.seed, aux_layer_ids=aux_layer_ids)
    if settings.kind == "eagle":  # scored at inference through those rows of the target's lm_head (draft_vocab.json)
        head.train_vocab = vocab
    if settings.kind == "eagle3":  # start the draft lm_head from the target's rows of the draft vocabulary
        with torch.no_grad():
            head.lm_head.weight.copy_(target.model.lm_head_weight.float()[head.draft_to_target()])
    return head


def mask_token_id(target: LoadedModel) -> int:
    """The block drafter's mask token: the tokenizer's own mask (or unknown) token, else the last id."""
    tokenizer = target.tokenizer
    for token in (getattr(tokenizer, "mask_token_id", None), getattr(tokenizer, "unk_token_id", None)):
        if token is not None and 0 <= token < target.model.spec.vocab_size:
            return int(token)
    return target.model.spec.vocab_size - 1


def train(settings: TrainSettings, target: LoadedModel, records: list[dict], out_dir,
          aux_layer_ids: list[int] | None = None, progress: bool = True):
    """Train a head (resuming from out_dir/checkpoint.pt when present); writes the head in its published layout
    to out_dir and returns it. Target weights stay frozen."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    target.model.requires_grad_(False)
    device = training_device()
    module = build_module(settings, target, records, aux_layer_ids).float().to(device).train()
    frozen = FrozenTarget(target, device, getattr(module, "train_vocab", None)) \
        if settings.kind in ("eagle", "eagle3", "dflash") else None
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay,
                                  betas=(0.9, 0.95))
    start, history = resume(out_dir / CHECKPOINT, settings, module, optimizer)
    autocast = device.type == "cuda" or (target.model.dtype == torch.bfloat16 and native_bf16_matmul())
    bar = tqdm(range(start, settings.steps), initial=start, total=settings.steps, desc=f"train {settings.kind}",
               disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        optimizer.zero_grad(set_to_none=True)
        loss_sum, acc_sum = 0.0, 0.0
        for micro in range(settings.grad_accum):
            batch = {k: v.to(device) for k, v in sample_windows(records, settings, step, micro).items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                if settings.kind == "medusa":
                    loss, accuracy = medusa_loss(module, batch)
                elif settings.kind == "draft":
                    loss, accuracy = draft_loss(module, batch, module.train_vocab.to(device))
                elif settings.kind == "dflash":
                    anchors = torch.Generator().manual_seed(settings.seed * 1_000_003 + step * 131 + micro + 7)
                    loss, accuracy = block_loss(module, frozen, batch, settings.anchors, anchors)
                else:
                    loss, accuracy = eagle_loss(module, frozen, batch, settings.ttt_steps)
            (loss / settings.grad_accum).backward()
            loss_sum += float(loss.detach()) / settings.grad_accum
            acc_sum += accuracy / settings.grad_accum
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        history.append({"step": step, "loss": loss_sum, "accuracy": acc_sum})
        bar.set_postfix(loss=f"{loss_sum:.3f}", acc=f"{acc_sum:.2f}")
        if (step + 1) % settings.save_every == 0 or step + 1 == settings.steps:
            atomic_save({"settings": asdict(settings), "step": step + 1, "module": module.state_dict(),
                         "optimizer": optimizer.state_dict(), "history": history}, out_dir / CHECKPOINT)
    module = module.cpu().eval()
    write_head(module, settings, target, out_dir)
    (out_dir / "train_history.json").write_text(json.dumps(history))
    return module


def resume(path: Path, settings: TrainSettings, module, optimizer) -> tuple[int, list]:
    if not path.exists():
        return 0, []
    state = torch.load(path, weights_only=False, map_location=next(module.parameters()).device)
    saved = state["settings"]
    differing = [k for k in saved if k not in ("steps", "save_every") and saved[k] != asdict(settings).get(k)]
    if differing:
        raise ValueError(f"{path} was written with other settings ({', '.join(differing)}): resume with the same "
                         f"ones or use another --out")
    try:
        module.load_state_dict(state["module"])
    except RuntimeError as exc:
        raise ValueError(f"{path} does not match this target's head shapes: {exc}") from None
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["history"]


def write_head(module, settings: TrainSettings, target: LoadedModel, out_dir: Path) -> None:
    """The trained head in its published layout (bfloat16 weights, as published heads are half precision)."""
    tmp = out_dir / ".writing"
    if settings.kind == "draft":
        save_draft_model(module, target, tmp)
    elif settings.kind == "dflash":
        save_dflash(module.to(torch.bfloat16), tmp)
    elif settings.kind == "medusa":
        with torch.no_grad():  # the trained rows back into the published full-vocabulary lm_heads
            for head, rows in zip(module.heads, module.vocab_rows):
                head[-1].weight[module.train_vocab] = rows.to(head[-1].weight.dtype)
        half = module.to(torch.bfloat16)
        half.restrict_vocab(module.train_vocab if module.train_vocab.numel() < module.vocab_size else None)
        save_medusa(half, tmp, vocab_rows_only=settings.vocab_rows_only)
        half.restrict_vocab(None)
    else:
        half = module.to(torch.bfloat16)
        save_eagle(half, tmp, safetensors=True)
    # the vocabulary a draft model or an EAGLE-1 head scores at inference (Medusa's goes with its heads)
    if settings.kind in ("draft", "eagle", "dflash") and module.train_vocab.numel() < target.model.spec.vocab_size:
        write_draft_vocab(tmp, module.train_vocab)
    for file in tmp.iterdir():
        os.replace(file, out_dir / file.name)
    tmp.rmdir()
    module.float()
