"""Training a DFlash block drafter (`speculative/dflash.py`) on self-distillation windows.

Each window's target features are injected once as the context's keys and values; `anchors` positions a of it are
drawn (where the label after a is the target's own) and each becomes a block [token a, mask * (B - 1)] at
positions a .. a + B - 1 that sees the context before a and its own block, exactly as drafting after a committed
prefix of a tokens sees them. All of a window's blocks run in one drafter forward under that mask. Block position j
is labelled with the target's argmax after position a + j - 1, its cross-entropy over the draft vocabulary's rows
of the target's lm_head weighted by exp(-(j - 1) / gamma), gamma = B / 2 (DFlash's decay: early positions decide
how much of a block is accepted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.speculative.dflash import DFlashDrafter


def draw_anchors(valid: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """[b, count] anchor positions per window: positions a >= 1 whose next label is valid (with repeats when a
    window has fewer). A window with none gets anchors whose labels are all invalid."""
    weights = valid.float().clone()
    weights[:, 0] = 0
    weights[weights.sum(-1) == 0] = 1.0
    return torch.multinomial(weights, count, replacement=True, generator=generator)


def block_mask(anchors: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """[b, M * B, context + M * B] bool: block m's rows see context positions < anchor m and all of block m."""
    b, m = anchors.shape
    sees_context = torch.arange(context, device=anchors.device) < anchors[..., None]  # [b, M, context]
    block_of = torch.arange(m * block, device=anchors.device) // block
    same_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context.repeat_interleave(block, 1), same_block], -1)


def block_loss(drafter: DFlashDrafter, target, batch: dict, anchors_per_window: int,
               generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """The weighted cross-entropy of a micro-batch of windows (`heads.sample_windows`) and the first position's
    top-1 accuracy. `target`: `heads.FrozenTarget` (embedding table, lm_head rows of the draft vocabulary)."""
    cfg = drafter.config
    size = cfg.block_size
    tokens, labels, valid = batch["tokens"], batch["labels"], batch["valid"]
    b, length = tokens.shape
    device = tokens.device
    anchors = draw_anchors(valid.cpu(), anchors_per_window, generator).to(device)  # [b, M]
    offsets = torch.arange(size, device=device)
    drafted = offsets.bool().repeat(anchors_per_window)[None]  # [1, M * B]: the rows after each block's anchor
    at = (anchors[..., None] + offsets).reshape(b, -1)  # [b, M * B] positions of the blocks' rows
    block_tokens = torch.where(drafted, cfg.mask_token_id,
                               tokens.gather(1, anchors).repeat_interleave(size, 1))
    embeds = F.embedding(block_tokens, target.embed_table) * cfg.input_embedding_scale
    context = drafter.context(batch["aux"], torch.arange(length, device=device)[None].expand(b, -1))
    outputs = drafter.block(embeds, at, context, block_mask(anchors, length, size))
    # row (m, j) guesses the token at a + j: the label after position a + j - 1 (j >= 1)
    source = (at - 1).clamp(0, length - 1)  # an anchor at 0 has no label before it: its row is not drafted
    target_ids = labels.gather(1, source)
    ok = valid.gather(1, source) & (at - 1 < length) & drafted
    ids = target.labels(target_ids)
    ok &= ids >= 0
    weight = torch.exp(-(offsets - 1).clamp(min=0).float() / (size / 2)).repeat(anchors_per_window).to(device)
    weight = weight[None].expand(b, -1)[ok]
    logits = target.logits(outputs[ok])
    loss = (F.cross_entropy(logits, ids[ok], reduction="none") * weight).sum() / weight.sum().clamp(min=1e-6)
    first = (offsets == 1).repeat(anchors_per_window)[None].expand(b, -1)[ok]
    accuracy = float((logits[first].argmax(-1) == ids[ok][first]).float().mean()) if bool(first.any()) else 0.0
    return loss, accuracy
