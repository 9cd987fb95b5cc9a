"""A small draft model of the target's own family and tokenizer, distilled from the target.

It starts as the target with most decoder layers dropped (evenly spaced ones kept, so the residual stream still
reaches the final norm in the shape the lm_head expects) and learns the target's greedy next tokens on the
self-distillation data. The token embedding and lm_head stay frozen (they are most of a small model's weights
and already right); the result is an ordinary HF checkpoint directory that `load_model` and Draft_Target read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from specserve.models.loader import LoadedModel
from specserve.models.transformer import soft_cap
from specserve.train.vocab import subset_labels


def kept_layers(num_layers: int, keep: int) -> list[int]:
    keep = max(1, min(keep, num_layers))
    if keep == 1:
        return [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def new_draft_model(target: LoadedModel, num_layers: int):
    """The target's family with `num_layers` of its layers (evenly spaced), in float32, embeddings frozen."""
    config = AutoConfig.from_pretrained(target.path)
    text = getattr(config, "text_config", None) or config
    layers = kept_layers(text.num_hidden_layers, num_layers)
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[i] for i in layers]
    text.num_hidden_layers = len(layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for name, value in target.dense_weights().items():
        parts = name.split(".")
        if "layers" in parts:
            at = parts.index("layers") + 1
            source = int(parts[at])
            if source not in layers:
                continue
            parts[at] = str(layers.index(source))
        state[".".join(parts)] = value.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"cannot start a draft model from {target.path}: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    return model


def draft_loss(model, batch: dict, vocab_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Cross-entropy against the target's argmax at each real position, over the draft vocabulary."""
    hidden = model.model(input_ids=batch["tokens"]).last_hidden_state
    logits = soft_cap(F.linear(hidden, model.get_output_embeddings().weight[vocab_ids]).float(),
                      getattr(model.config, "final_logit_softcapping", None))
    labels = subset_labels(batch["labels"], vocab_ids, model.get_output_embeddings().weight.shape[0])
    valid = batch["valid"] & (labels >= 0)
    loss = F.cross_entropy(logits[valid], labels[valid])
    accuracy = float((logits[valid].argmax(-1) == labels[valid]).float().mean())
    return loss, accuracy


def save_draft_model(model, target: LoadedModel, directory: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    model.float()
