"""Medusa heads' drafting forward on the CPU kernels: every linear in int4 blocks (or int8, `quantization`), only
the heads a tree reaches.

A step drafts from one hidden state (the target's last), so each head is a chain of one-row products: its
ResBlocks (x + SiLU(W x + b)) and its lm_head over the draft vocabulary. In PyTorch these are bf16 GEMMs, which a
CPU without bf16 units emulates: the three shipped heads (6,144-row lm_heads) took a fifth of a target step on an
AVX2 CPU. Here each linear is packed in blocks of 32 (quant.py) and runs as one kernel call with
fp32 outputs, the SiLU and residual in fp32, and a step runs a head only where the tree budget finds its level
worth drafting (`medusa_draft.py`). A step drafts right after the target's forward has evicted the heads from the
caches, so their bytes set the time: int4 is the default, as for EAGLE heads (eagle_kernels.py).

Drafts are proposals, never verdicts: quantized weights change which tokens are proposed, not the output, which
the target's verification fixes (the losslessness tests draft on this path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models import cpu_kernels
from specserve.speculative.eagle_kernels import DEFAULT_HEAD_QUANTIZATION, bias_free_linear, fp32_outputs, packed
from specserve.speculative.medusa import MedusaHeads


def usable(heads: MedusaHeads) -> bool:
    """bf16 heads on a CPU that runs the kernels."""
    weight = heads.heads[0][-1].weight
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and cpu_kernels.available()


class KernelMedusa:
    """`MedusaHeads.head_logits` on the kernels."""

    def __init__(self, heads: MedusaHeads, quantization: str = DEFAULT_HEAD_QUANTIZATION):
        self.blocks = [[packed(block.linear, quantization) for block in head[:-1]] for head in heads.heads]
        self.lm_heads = [packed(bias_free_linear(weight), quantization) for weight in heads.lm_weights]

    def head_logits(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """Head `index`'s fp32 logits [V'] at one hidden state [H]."""
        y = hidden.reshape(1, -1).float()
        for block in self.blocks[index]:
            y = y + F.silu(fp32_outputs(block, y))
        return fp32_outputs(self.lm_heads[index], y)[0]
