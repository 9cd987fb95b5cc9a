"""Drafting trees with an EAGLE head: EAGLE-1's static tree, EAGLE-2's dynamic tree, EAGLE-3 (dynamic).

Per request the head keeps its own KV cache over the committed pairs (feature of token t, token t + 1). Each
step it first runs the pairs committed since the last step, then grows a tree level by level from the pending
token (the root): a level runs the head once over the nodes it expands (their parents' outputs as features,
tree-masked), and their children are the top-k of the head's logits. The tree's nodes are deterministic
candidates, so the verifier's rejection sampling keeps sampling lossless and greedy output equals plain decoding
whatever the head predicts.

Dynamic trees (EAGLE-2) score a node by its path's cumulative draft log-probability, expand the `top_k` best
nodes of each level and keep the `total_tokens` best nodes overall. With the target's measured verify cost
(`verify_seconds`), `tree_budget.TreeBudget` chooses the tree's size and depth per step instead.

With `lookup` (prompt lookup as a branch), the n-gram continuation of the sequence (as `ngram` drafts it) is merged
into the drafted tree: where the head drafted the same tokens the nodes are shared, the rest hangs below them as a
chain. A lookup node at depth d scores the chance that the chain's first d tokens are accepted, from how often
lookups of that n-gram length were right at their first token and, their predecessor right, at each later one
(`acceptance.py`, the request's own and the method's over requests), so the budget weighs it against the head's
nodes; with measured costs, a step whose chain alone promises the tokens/s of the last head-drafted tree skips
the head. Head and lookup catch different tokens (the head: the target's style; lookup: text copied from the
prompt or repeated), and both are deterministic candidates, so verification stays lossless. With `suffix` instead
(`eagle3+suffix`), the branch is suffix decoding's best chain (`suffix.py`: the request's own text and the model's
cache of earlier responses), judged the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from specserve.checks import ConfigError, int_at_least
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel
from specserve.models.step_costs import measured_step_costs
from specserve.speculative import eagle_kernels
from specserve.speculative.base import DraftKind, MethodEntry, Proposal, Proposer
from specserve.speculative.branched import (BRANCHES, COMBINED_DRAFT_CAP, BranchedMethod, BranchedProposer,
                                            BranchOptions, Branches)
from specserve.speculative.choices import DEFAULT_CHOICES
from specserve.speculative.eagle import EagleHead, default_aux_layer_ids, detect_kind, load_eagle, read_state
from specserve.speculative.policy.tree_budget import Nodes, TreeBudget
from specserve.speculative.weights import read_draft_vocab


class EagleMethod(BranchedMethod):
    needs_hidden_states = True

    def __init__(self, head: EagleHead, target_model, name: str, max_depth: int, top_k: int = 8,
                 total_tokens: int = 60,
                 choices: list[list[int]] | None = None, aux_layer_ids: list[int] | None = None,
                 verify_seconds: Callable[[int], float] | None = None, branches: Branches | None = None,
                 head_quantization: str = eagle_kernels.DEFAULT_HEAD_QUANTIZATION,
                 draft_vocab: torch.Tensor | None = None):
        """`choices` given: a static tree (EAGLE-1); else a dynamic one of `top_k` branching and at most
        `total_tokens` draft nodes. `verify_seconds(n)`: the target's cost of verifying n tokens, enabling the
        hardware-aware budget (a dynamic tree grows and is cut by it; a static tree is cut to its best subtree).
        `aux_layer_ids`: EAGLE-3's fused target layers (inputs of those layers). `branches`: the lookup chain
        merged into every tree (prompt lookup's or a suffix method's; none by default).
        `head_quantization`: the head's weights on the kernels ("int8", "int4" or "none": bf16), eagle_kernels.py.
        `draft_vocab` (EAGLE-1, the head's draft_vocab.json): the target ids its drafts are scored over, through
        those rows of the target's lm_head, instead of the whole vocabulary."""
        if top_k < 1 or total_tokens < 1:
            raise ValueError(f"need top_k >= 1 and total_tokens >= 1, got {top_k}, {total_tokens}")
        self.branches = branches or Branches()
        self.name = name
        self.max_depth = max_depth
        self.head = head
        self.target = target_model
        self.top_k, self.total_tokens = top_k, total_tokens
        self.choices = [list(c) for c in choices] if choices else None
        self.verify_seconds = verify_seconds
        if head.kind == "eagle3":
            # the input of layer i is the output of layer i - 1
            self.hidden_layers = tuple(int(i) - 1 for i in aux_layer_ids)
            self.vocab_map = head.draft_to_target()
        else:
            self.hidden_layers = (-1,)
            self.vocab_map = None
        self.kernels = eagle_kernels.KernelHead(head, head_quantization) if eagle_kernels.usable(head) else None
        self.vocab_rows = None  # EAGLE-1's lm_head over its draft vocabulary: those rows of the target's
        whole_head = getattr(target_model, "lm_head_shard", None) is None  # a shard holds other rows
        if head.kind != "eagle3" and draft_vocab is not None and whole_head:
            self.vocab_map = draft_vocab.sort().values
            self.vocab_rows = eagle_kernels.target_rows(target_model, self.vocab_map,
                                                        head_quantization if self.kernels is not None else "none")

    @property
    def draft_kind(self) -> DraftKind:
        return DraftKind.SIZED_TREE if self.verify_seconds is not None else DraftKind.HEAD_TREE

    def tree_nodes(self, depth: int) -> int:
        if self.choices is not None:
            return sum(len(c) <= depth for c in self.choices)
        return self.total_tokens

    def expanded_nodes(self, depth: int) -> int:
        """Head-cache slots a tree of this depth may take (nodes the head runs on)."""
        if self.choices is not None:
            return len({tuple(c[:-1]) for c in self.choices if len(c) <= depth})
        return self.top_k * depth

    def draft_slots(self, max_draft_len: int) -> int:
        return 1 + self.tree_nodes(max_draft_len) + (max_draft_len if self.branches else 0)

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return EagleProposer(self, capacity, params)


    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        head = self.head
        table = head.embed_tokens if hasattr(head, "embed_tokens") else self.target.model.embed_tokens
        return table(tokens)  # the target's may be packed (QuantEmbedding): only these rows are dequantized

    def run_head(self, features, embeds, positions, cache: KVCache, slots, mask) -> tuple[torch.Tensor, ...]:
        """(the head's outputs [T, h], their draft lm_head inputs) on the kernels where they run, else PyTorch."""
        if self.kernels is not None:
            return self.kernels.forward(features, embeds, positions, cache, slots, mask)
        out = self.head(features, embeds, positions, cache, slots, mask)
        return out, self.head.lm_inputs(out)

    def log_probs(self, lm_inputs: torch.Tensor) -> torch.Tensor:
        """[T, V'] draft log-probabilities of run_head's lm_head inputs (EAGLE-3: over the draft vocabulary)."""
        fast = self.target.kernels_usable and lm_inputs.shape[0] <= 64  # the lm_head kernel, when it runs here
        target_logits = self.vocab_rows if self.vocab_rows is not None else lambda x: self.target.logits(x, fast)
        drafter = self.kernels if self.kernels is not None else self.head
        return torch.log_softmax(drafter.draft_logits(lm_inputs, target_logits), dim=-1)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.vocab_map is None else self.vocab_map[ids]


# a drafted path the head gives less than this chance (calibrated) adds too few tokens to pay for its row
MIN_PATH_PROBABILITY = 1e-3


class EagleProposer(BranchedProposer):
    def __init__(self, method: EagleMethod, capacity: int, params):
        self.m = method
        head_capacity = capacity + method.expanded_nodes(method.max_depth) + 1
        self.cache = method.head.new_cache(head_capacity)
        self.stable = 0  # pairs whose keys/values are in the head cache
        self.features: list[torch.Tensor] = []  # target features of committed tokens not yet run
        self.last_output: torch.Tensor | None = None  # the head's output at the last committed pair
        self.last_lm_input: torch.Tensor | None = None  # and its draft lm_head input (the root's logits)
        self.budget = TreeBudget(method.verify_seconds, method.top_k, method.total_tokens, method.choices is not None)
        self.lookup = method.branches.for_request(params, capacity)

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        if max_len <= 0 or (not self.features and self.last_output is None):
            return Proposal.chain(tokens[-1], [])
        chain, reach = self.branch_chain(tokens, max_len)
        if self.budget.lookup_alone_pays(reach):
            return self.lookup_only(tokens[-1], chain, reach)
        start = time.perf_counter()
        self._catch_up(tokens)
        nodes = self._grow(tokens[-1], max_len, chain, reach)
        keep = self.budget.select(nodes)
        if self.lookup is not None:
            self.budget.note_head_rate(nodes, keep, time.perf_counter() - start)
        if not keep:
            return Proposal.chain(tokens[-1], [])
        self.budget.expect(nodes, keep)
        return Proposal(nodes.tree(keep))

    def _catch_up(self, tokens: list[int]) -> None:
        """Run the head over the pairs (feature t, token t + 1) committed since the last step."""
        if not self.features:
            return
        features = torch.cat(self.features)
        self.features = []
        committed = len(tokens) - 1
        start = committed - features.shape[0]
        if start != self.stable:
            raise RuntimeError(f"EAGLE head out of step: {self.stable} pairs cached, {start} expected")
        positions = torch.arange(start, committed)
        embeds = self.m.embed(torch.tensor(tokens[start + 1: committed + 1]))
        mask = torch.ones(len(positions), committed, dtype=torch.bool).tril(diagonal=start)
        out, lm_inputs = self.m.run_head(features, embeds, positions, self.cache, positions, mask)
        self.stable = committed
        self.last_output, self.last_lm_input = out[-1], lm_inputs[-1]

    def _run_level(self, nodes: Nodes, expand: list[int]) -> torch.Tensor:
        """Run the head on the nodes in `expand` (one depth); returns their draft log-probs [len(expand), V']."""
        start = time.perf_counter()
        first_slot = self.stable + len(nodes.slots)
        for i, node in enumerate(expand):
            nodes.slots[node] = first_slot + i
        width = first_slot + len(expand)
        mask = torch.zeros(len(expand), width, dtype=torch.bool)
        mask[:, : self.stable] = True
        for i, node in enumerate(expand):
            mask[i, [nodes.slots[a] for a in nodes.ancestors(node)]] = True
        slots = torch.tensor([nodes.slots[n] for n in expand])
        positions = torch.tensor([self.stable - 1 + nodes.depths[n] for n in expand])
        features = torch.stack([nodes.outputs[nodes.parents[n]] for n in expand])
        embeds = self.m.embed(torch.tensor([nodes.tokens[n] for n in expand]))
        out, lm_inputs = self.m.run_head(features, embeds, positions, self.cache, slots, mask)
        for i, node in enumerate(expand):
            nodes.outputs[node] = out[i]
        logp = self.m.log_probs(lm_inputs)
        self.budget.time_level(time.perf_counter() - start)
        return logp

    def _add_children(self, nodes: Nodes, parent: int, logp: torch.Tensor, ranks: list[int]) -> list[int]:
        return self._add_level(nodes, [parent], logp[None], [ranks])

    def _add_level(self, nodes: Nodes, parents: list[int], logp: torch.Tensor, ranks: list[list[int]]) -> list[int]:
        """The children of each parent (row i of logp [P, V'] scores parent i's): its ranks' top tokens. One top-k
        and one copy to Python for the whole level (per parent they cost more than the head's forward)."""
        ranks = [[r for r in rs if r < logp.shape[-1]] for rs in ranks]  # a draft vocabulary smaller than top_k
        k = max((max(rs) + 1 for rs in ranks if rs), default=0)
        if not k:
            return []
        top = torch.topk(logp, k, dim=-1)
        ids = self.m.to_target_ids(top.indices).tolist()
        values = top.values.tolist()
        self.budget.observe_level([row[0] for row in values])
        # a dynamic tree under measured costs drops paths too unlikely to pay for a verified row: most of a level's
        # top-k children, whose nodes otherwise cost more Python (scoring, sorting) than the head's forward. Each
        # parent keeps its best child, so even a flat head's tree has nodes to verify and calibrate against
        floor = self._path_floor() if self.m.choices is None else -math.inf
        return [nodes.add(parent, ids[i][r], values[i][r], r)
                for i, (parent, rs) in enumerate(zip(parents, ranks)) for r in rs
                if nodes.scores[parent] + values[i][r] >= floor or r == 0]

    def _path_floor(self) -> float:
        """The lowest path score worth drafting below: MIN_PATH_PROBABILITY once calibrated, under measured costs."""
        if self.budget.verify_seconds is None:
            return -math.inf
        return math.log(MIN_PATH_PROBABILITY / self.budget.calibration)

    def _grow(self, root_token: int, max_len: int, chain: list[int], reach: list[float]) -> Nodes:
        m = self.m
        nodes = Nodes(root_token, self.last_output)
        root_logp = m.log_probs(self.last_lm_input[None])[0]
        if m.choices is not None:
            nodes = self._grow_static(nodes, root_logp, max_len)
            self.merge(nodes, chain, reach)
            return nodes
        level = self._add_children(nodes, 0, root_logp, list(range(m.top_k)))
        # the lookup chain joins before the head's deeper levels: a good chain raises the rate that each further
        # level must beat, so the head stops drafting where the lookup already covers the step
        self.merge(nodes, chain, reach)
        for _ in range(max_len - 1):
            expand = sorted(level, key=lambda n: -nodes.scores[n])[: m.top_k]
            if not self.budget.worth_another_level(nodes, expand):
                break
            logp = self._run_level(nodes, expand)
            level = self._add_level(nodes, expand, logp, [list(range(m.top_k))] * len(expand))
        return nodes

    def _grow_static(self, nodes: Nodes, root_logp: torch.Tensor, max_len: int) -> Nodes:
        choices = [tuple(c) for c in self.m.choices if len(c) <= max_len]
        children: dict[tuple, list[int]] = {}
        for c in sorted(set(choices), key=lambda c: (len(c), c)):
            children.setdefault(c[:-1], []).append(c[-1])
        by_path = {(): 0}
        for child in self._add_children(nodes, 0, root_logp, children.get((), [])):
            by_path[nodes.paths[child]] = child
        depth = 1
        while True:
            expand = [n for p, n in by_path.items() if len(p) == depth and p in children]
            # under measured costs, only the part that can pay is drafted: EAGLE-1's levels run the target's
            # 262k-token lm_head over every expanded node
            floor = self._path_floor()
            expand = self.budget.worth_expanding(nodes, [n for n in expand if nodes.scores[n] >= floor])
            if not expand:
                return nodes
            logp = self._run_level(nodes, expand)
            for i, node in enumerate(expand):
                for child in self._add_children(nodes, node, logp[i], children[nodes.paths[node]]):
                    by_path[nodes.paths[child]] = child
            depth += 1


# ---- configuration --------------------------------------------------------------------------------------------

DYNAMIC_TREE_KEYS = frozenset({"top_k", "depth", "total_token", "max_non_leaves_per_layer", "dynamic_tree_max_topK",
                               "num_eagle_layers", "max_total_draft_tokens"})


@dataclass
class EagleOptions(BranchOptions):
    """Tree settings in the EAGLE repository's spelling (`top_k`, `total_token` = nodes including the root) or
    TensorRT-LLM's (`max_non_leaves_per_layer` or `dynamic_tree_max_topK`, `max_total_draft_tokens`); the depth
    (`depth` = levels after the first, `num_eagle_layers`) is read as max_draft_len by the model.yaml reader."""

    choices: list[list[int]] | None = None  # eagle_choices: EAGLE-1's static tree; None: mc_sim_7b_63
    top_k: int = 8  # dynamic trees: children per expanded node and nodes expanded per level
    total_tokens: int = 48  # dynamic trees: draft nodes at most (the budget may choose fewer)
    layers: list[int] | None = None  # eagle3_layers_to_capture; None: the head's config or the default
    # the head's weights when it drafts on the CPU kernels: int4, int8 or none (bf16)
    quantization: str = eagle_kernels.DEFAULT_HEAD_QUANTIZATION
    KEYS: ClassVar[frozenset[str]] = DYNAMIC_TREE_KEYS | BranchOptions.KEYS | {
        "eagle_choices", "use_dynamic_tree", "eagle3_layers_to_capture", "quantization", "eagle3_one_model",
        "greedy_sampling"}  # the last two: TRT-LLM engine choices, nothing to do

    @classmethod
    def read(cls, settings: dict) -> dict:
        out = {"choices": settings.get("eagle_choices"), **BranchOptions.read(settings)}
        for key in ("top_k", "max_non_leaves_per_layer", "dynamic_tree_max_topK"):
            if key in settings:
                out["top_k"] = int_at_least(settings[key], key)
        if "total_token" in settings:
            out["total_tokens"] = int_at_least(settings["total_token"], "total_token", 2) - 1
        if "max_total_draft_tokens" in settings:
            out["total_tokens"] = int_at_least(settings["max_total_draft_tokens"], "max_total_draft_tokens")
        layers = settings.get("eagle3_layers_to_capture")
        if layers is not None:
            if not isinstance(layers, list) or len(layers) != 3:
                raise ConfigError(f"eagle3_layers_to_capture must list 3 target layers, got {layers!r}")
            out["layers"] = [int_at_least(layer, "eagle3_layers_to_capture", 1) for layer in layers]
        return {**out, **eagle_kernels.read_quantization(settings, "an EAGLE head")}


def build(options: EagleOptions, target: LoadedModel) -> EagleMethod:
    spec = target.model.spec
    try:
        head = load_eagle(options.model, "eagle3" if options.name == "eagle3" else "eagle", spec,
                          dtype=target.model.dtype)
        aux = options.layers or head.config.aux_layer_ids or default_aux_layer_ids(spec.num_layers)
        if any(not 1 <= int(i) <= spec.num_layers for i in aux):
            raise ValueError(f"EAGLE-3 target layers {aux} must lie in 1..{spec.num_layers}")
        static = options.name == "eagle" or options.choices is not None
        verify_seconds = measured_step_costs(target) if options.adaptive_draft_len else None
        draft_vocab = read_draft_vocab(Path(options.model), spec.vocab_size) if head.kind == "eagle" else None
        return EagleMethod(head, target.model, options.label, options.max_draft_len, top_k=options.top_k,
                           total_tokens=options.total_tokens,
                           choices=(options.choices or DEFAULT_CHOICES) if static else None, aux_layer_ids=aux,
                           verify_seconds=verify_seconds, branches=Branches.of(options, target),
                           head_quantization=options.quantization, draft_vocab=draft_vocab)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot use EAGLE head {options.model}: {exc}") from None


def head_kind(directory: str) -> str | None:
    """"eagle" / "eagle3" when the directory holds an EAGLE head of that layout, else None."""
    path = Path(directory)
    if not (path / "config.json").exists():
        return None
    try:
        return detect_kind(read_state(path))
    except (OSError, ValueError, RuntimeError):
        return None


def dynamic_if_asked(settings: dict) -> MethodEntry:
    """`Eagle` with use_dynamic_tree or a dynamic-tree knob is EAGLE-2."""
    return EAGLE2 if settings.get("use_dynamic_tree") or DYNAMIC_TREE_KEYS & set(settings) else EAGLE1


HEAD = "the directory of the EAGLE head"
EAGLE1 = MethodEntry("eagle", EagleOptions, build, aliases=("eagle1",), trtllm="Eagle", model_needed=HEAD,
                     head_kind="eagle", combines=BRANCHES, variant=dynamic_if_asked, sized_trees=True,
                     combined_draft_cap=COMBINED_DRAFT_CAP)
EAGLE2 = MethodEntry("eagle2", EagleOptions, build, vllm=("eagle",), model_needed=HEAD,  # vLLM's EAGLE: dynamic
                     holds_head=lambda directory: head_kind(directory) == "eagle", trains="eagle",
                     head_kind="eagle", combines=BRANCHES, sized_trees=True,
                     combined_draft_cap=COMBINED_DRAFT_CAP)
EAGLE3 = MethodEntry("eagle3", EagleOptions, build, trtllm="Eagle3", vllm=("eagle3",), model_needed=HEAD,
                     holds_head=lambda directory: head_kind(directory) == "eagle3", trains="eagle3",
                     head_kind="eagle3", combines=BRANCHES, sized_trees=True,
                     combined_draft_cap=COMBINED_DRAFT_CAP)
