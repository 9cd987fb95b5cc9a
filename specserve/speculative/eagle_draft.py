"""Drafting trees with an EAGLE head: EAGLE-1's static tree, EAGLE-2's dynamic tree, EAGLE-3 (dynamic).

Per request the head keeps its own KV cache over the committed pairs (feature of token t, token t + 1). Each
step it first runs the pairs committed since the last step, then grows a tree level by level from the pending
token (the root): a level runs the head once over the nodes it expands (their parents' outputs as features,
tree-masked), and their children are the top-k of the head's logits. The tree's nodes are deterministic
candidates, so `tree.verify_tree_sampling` keeps sampling lossless and greedy output equals plain decoding
whatever the head predicts.

Dynamic trees (EAGLE-2) score a node by its path's cumulative draft log-probability, expand the `top_k` best
nodes of each level and keep the `total_tokens` best nodes overall. With the target's measured verify cost
(`verify_seconds`), the tree size and depth are chosen per step instead: keep the N best nodes that maximize
(1 + c * sum of their path probabilities) / (verify cost of N + 1 tokens + drafting time), and draft another
level only while its best possible gain per second beats that rate; c calibrates the head's confidence against
the acceptance it actually gets.

With `lookup` (prompt lookup as a branch), the n-gram continuation of the sequence (as `ngram` drafts it) is merged
into the drafted tree: where the head drafted the same tokens the nodes are shared, the rest hangs below them as a
chain. A lookup node at depth d scores r^d, r being how often lookups of that n-gram length were right per token
so far in the request, so the budget weighs it against the head's nodes; with measured costs, a step whose chain
alone promises the tokens/s of the last head-drafted tree skips the head. Head and lookup catch different tokens
(the head: the target's style; lookup: text copied from the prompt or repeated), and both are deterministic
candidates, so verification stays lossless.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from specserve.speculative.eagle import EagleHead, HeadCache
from specserve.speculative.proposers import Proposal, Proposer, SpecMethod, common_prefix_length, ngram_lookup
from specserve.speculative.tree import DraftTree


class EagleMethod(SpecMethod):
    needs_hidden_states = True

    def __init__(self, head: EagleHead, target_model, name: str, max_depth: int, top_k: int = 8,
                 total_tokens: int = 60,
                 choices: list[list[int]] | None = None, aux_layer_ids: list[int] | None = None,
                 verify_seconds: Callable[[int], float] | None = None, lookup: tuple[int, int] | None = None):
        """`choices` given: a static tree (EAGLE-1); else a dynamic one of `top_k` branching and at most
        `total_tokens` draft nodes. `verify_seconds(n)`: the target's cost of verifying n tokens, enabling the
        hardware-aware budget (a dynamic tree grows and is cut by it; a static tree is cut to its best subtree).
        `aux_layer_ids`: EAGLE-3's fused target layers (inputs of those layers). `lookup` (min n, max n): merge
        prompt lookup's continuation into every tree."""
        if top_k < 1 or total_tokens < 1:
            raise ValueError(f"need top_k >= 1 and total_tokens >= 1, got {top_k}, {total_tokens}")
        if lookup is not None and not 1 <= lookup[0] <= lookup[1]:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lookup[0]}, {lookup[1]}")
        self.lookup = lookup
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

    @property
    def budgets_itself(self) -> bool:
        return self.verify_seconds is not None

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
        return 1 + self.tree_nodes(max_draft_len) + (max_draft_len if self.lookup else 0)

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return EagleProposer(self, capacity)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        head = self.head
        table = head.embed_tokens if hasattr(head, "embed_tokens") else self.target.model.embed_tokens
        return table(tokens)  # the target's may be packed (QuantEmbedding): only these rows are dequantized

    def log_probs(self, outputs: torch.Tensor) -> torch.Tensor:
        """[T, V'] draft log-probabilities at the head's outputs (EAGLE-3: over the draft vocabulary)."""
        fast = self.target.kernels_usable and outputs.shape[0] <= 64  # the lm_head kernel, when it runs here
        return torch.log_softmax(self.head.draft_logits(outputs, lambda x: self.target.logits(x, fast)), dim=-1)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.vocab_map is None else self.vocab_map[ids]


class Nodes:
    """A growing draft tree: node 0 is the root; per node its token, parent, depth, score (cumulative log-prob),
    the head's output once expanded and its head-cache slot."""

    def __init__(self, root_token: int, root_output: torch.Tensor):
        self.tokens, self.parents, self.depths, self.scores = [root_token], [-1], [0], [0.0]
        self.paths: list[tuple[int, ...]] = [()]
        self.outputs: dict[int, torch.Tensor] = {0: root_output}
        self.slots: dict[int, int] = {}
        self.looked_up = 0  # nodes the lookup branch added

    def child(self, parent: int, token: int) -> int | None:
        return next((c for c in range(1, len(self.tokens)) if self.parents[c] == parent and self.tokens[c] == token),
                    None)

    def add(self, parent: int, token: int, logp: float, rank: int) -> int:
        """A head-drafted child; a lookup node with the same token there becomes it (with the better score)."""
        shared = self.child(parent, token) if self.looked_up else None
        if shared is not None:
            self.scores[shared] = max(self.scores[shared], self.scores[parent] + logp)
            self.paths[shared] = self.paths[parent] + (rank,)
            self.looked_up -= 1
            return shared
        return self._append(parent, token, self.scores[parent] + logp, rank)

    def _append(self, parent: int, token: int, score: float, rank: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.paths.append(self.paths[parent] + (rank,))
        return len(self.tokens) - 1

    def merge_chain(self, chain: list[int], rate: float, offset: float) -> None:
        """Hang a lookup chain below the root, sharing nodes that carry the same tokens; its node at depth d
        scores d * log(rate) - offset (unless the node already scores higher)."""
        node = 0
        for depth, token in enumerate(chain, start=1):
            score = depth * math.log(rate) - offset
            same = self.child(node, token)
            if same is not None:
                node = same
                self.scores[node] = max(self.scores[node], score)
            else:
                node = self._append(node, token, score, -1)
                self.looked_up += 1

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out

    def tree(self, keep: list[int]) -> DraftTree:
        """The tree of the root and `keep` (closed under parents), ordered by depth then score."""
        order = [0] + sorted(keep, key=lambda n: (self.depths[n], -self.scores[n]))
        index = {node: i for i, node in enumerate(order)}
        return DraftTree(torch.tensor([self.tokens[n] for n in order]),
                         torch.tensor([-1] + [index[self.parents[n]] for n in order[1:]]))


class EagleProposer(Proposer):
    def __init__(self, method: EagleMethod, capacity: int):
        self.m = method
        head_capacity = capacity + method.expanded_nodes(method.max_depth) + 1
        self.cache = HeadCache(method.head, head_capacity)
        self.stable = 0  # pairs whose keys/values are in the head cache
        self.features: list[torch.Tensor] = []  # target features of committed tokens not yet run
        self.last_output: torch.Tensor | None = None
        # calibration of the head's confidence: accepted tokens vs predicted (path probabilities), smoothed
        self.predicted, self.accepted = 1.0, 1.0
        self.pending_prediction: float | None = None
        self.level_seconds: float | None = None
        self.lookup = LookupBranch(*method.lookup) if method.lookup else None
        self.head_rate: float | None = None  # expected tokens/s of the last step the head drafted (with lookup)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.features.append(hidden)
        if self.pending_prediction is not None:
            self.predicted += self.pending_prediction
            self.accepted += hidden.shape[0] - 1  # rows: the root and each accepted node
            self.pending_prediction = None

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        if max_len <= 0 or (not self.features and self.last_output is None):
            return Proposal([])
        chain, rate = self.lookup.propose(tokens, max_len) if self.lookup is not None else ([], 0.0)
        if self._lookup_alone_pays(chain, rate):  # the head's pairs wait in self.features for a later step
            nodes = Nodes(tokens[-1], None)
            self._merge(nodes, chain, rate)
            keep = self._select(nodes)
        else:
            start = time.perf_counter()
            self._catch_up(tokens)
            nodes = self._grow(tokens[-1], max_len, chain, rate)
            keep = self._select(nodes)
            self._note_head_rate(nodes, keep, time.perf_counter() - start)
        if not keep:
            return Proposal([])
        self.pending_prediction = sum(math.exp(nodes.scores[n]) for n in keep)
        tree = nodes.tree(keep)
        return Proposal(tree.tokens[1:].tolist(), tree=tree)

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
        out = self.m.head(features, embeds, positions, self.cache, positions, mask)
        self.stable = committed
        self.last_output = out[-1]

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
        out = self.m.head(features, embeds, positions, self.cache, slots, mask)
        for i, node in enumerate(expand):
            nodes.outputs[node] = out[i]
        logp = self.m.log_probs(out)
        elapsed = time.perf_counter() - start
        self.level_seconds = elapsed if self.level_seconds is None else 0.8 * self.level_seconds + 0.2 * elapsed
        return logp

    def _add_children(self, nodes: Nodes, parent: int, logp: torch.Tensor, ranks: list[int]) -> list[int]:
        ranks = [r for r in ranks if r < logp.numel()]  # a draft vocabulary smaller than top_k
        if not ranks:
            return []
        top = torch.topk(logp, max(ranks) + 1)
        ids = self.m.to_target_ids(top.indices).tolist()
        values = top.values.tolist()
        return [nodes.add(parent, ids[r], values[r], r) for r in ranks]

    def _merge(self, nodes: Nodes, chain: list[int], rate: float) -> None:
        # stored scores are the head's uncalibrated ones: dividing by c keeps c * exp(score) = rate ** depth
        nodes.merge_chain(chain, rate, math.log(self._calibration()))

    def _note_head_rate(self, nodes: Nodes, keep: list[int], head_seconds: float) -> None:
        if self.lookup is not None and self.m.verify_seconds is not None:
            expected = 1.0 + self._calibration() * sum(math.exp(nodes.scores[n]) for n in keep)
            self.head_rate = expected / (self.m.verify_seconds(len(keep) + 1) + head_seconds)

    def _lookup_alone_pays(self, chain: list[int], rate: float) -> bool:
        """Whether verifying the lookup chain alone promises at least the tokens/s of the last head-drafted tree
        (measured costs only): then this step skips the head, which would cost a step's drafting."""
        if not chain or self.m.verify_seconds is None or self.head_rate is None:
            return False
        expected = 1.0
        best = 0.0
        for depth in range(1, len(chain) + 1):
            expected += rate ** depth
            best = max(best, expected / self.m.verify_seconds(depth + 1))
        return best >= self.head_rate

    def _grow(self, root_token: int, max_len: int, chain: list[int], rate: float) -> Nodes:
        m = self.m
        nodes = Nodes(root_token, self.last_output)
        root_logp = m.log_probs(self.last_output[None])[0]
        if m.choices is not None:
            nodes = self._grow_static(nodes, root_logp, max_len)
            self._merge(nodes, chain, rate)
            return nodes
        level = self._add_children(nodes, 0, root_logp, list(range(m.top_k)))
        # the lookup chain joins before the head's deeper levels: a good chain raises the rate that each further
        # level must beat, so the head stops drafting where the lookup already covers the step
        self._merge(nodes, chain, rate)
        for _ in range(max_len - 1):
            expand = sorted(level, key=lambda n: -nodes.scores[n])[: m.top_k]
            if not self._worth_another_level(nodes, expand):
                break
            logp = self._run_level(nodes, expand)
            level = [child for i, node in enumerate(expand)
                     for child in self._add_children(nodes, node, logp[i], list(range(m.top_k)))]
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
            if not expand:
                return nodes
            logp = self._run_level(nodes, expand)
            for i, node in enumerate(expand):
                for child in self._add_children(nodes, node, logp[i], children[nodes.paths[node]]):
                    by_path[nodes.paths[child]] = child
            depth += 1

    def _calibration(self) -> float:
        return self.accepted / self.predicted

    def _best_budget(self, nodes: Nodes) -> tuple[list[int], float]:
        """The best nodes to verify and the expected tokens per second of verifying them."""
        ranked = sorted(range(1, len(nodes.tokens)), key=lambda n: (-nodes.scores[n], nodes.depths[n]))
        limit = len(ranked) if self.m.choices is not None else min(len(ranked),
                                                                    self.m.total_tokens + nodes.looked_up)
        if self.m.verify_seconds is None:
            return ranked[:limit], 0.0
        c = self._calibration()
        probs = torch.tensor([nodes.scores[n] for n in ranked[:limit]]).exp()
        expected = 1.0 + c * torch.cat([torch.zeros(1), probs.cumsum(0)])
        drafting = (self.level_seconds or 0.0) * max(len(nodes.slots), 1) / max(self.m.top_k, 1)
        seconds = torch.tensor([self.m.verify_seconds(n + 1) for n in range(limit + 1)]) + drafting
        best = int((expected / seconds).argmax())
        return ranked[:best], float(expected[best] / seconds[best])

    def _worth_another_level(self, nodes: Nodes, expand: list[int]) -> bool:
        if self.m.verify_seconds is None or self.level_seconds is None:
            return True
        _, rate = self._best_budget(nodes)
        gain = self._calibration() * sum(math.exp(nodes.scores[n]) for n in expand)
        return gain / self.level_seconds > rate

    def _select(self, nodes: Nodes) -> list[int]:
        """The nodes to verify: all of a static tree, or (with measured costs) the budget's best closed subtree."""
        if self.m.choices is not None and self.m.verify_seconds is None:
            return list(range(1, len(nodes.tokens)))
        keep = set(self._best_budget(nodes)[0])
        # a child never outscores its parent, but ties could break the other way: keep the tree closed
        return [n for n in keep if all(a in keep for a in nodes.ancestors(n))]


class LookupBranch:
    """Prompt lookup for one request inside EAGLE trees, with its running accuracy per n-gram length: of the
    lookup tokens whose predecessors were right, how many the target then produced (judged against the tokens
    committed next, whether or not the budget verified them)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.right = {n: 1.0 for n in range(min_n, max_n + 1)}  # a prior of 1 right in 2
        self.judged = {n: 2.0 for n in range(min_n, max_n + 1)}
        self.last: tuple[int, int, list[int]] | None = None  # (sequence length, n, chain) of the last lookup

    def propose(self, tokens: list[int], max_len: int) -> tuple[list[int], float]:
        """The continuation (empty: no n-gram recurs) and its per-token accuracy estimate."""
        if self.last is not None:
            start, n, chain = self.last
            committed = tokens[start:]
            right = common_prefix_length(chain, committed)
            self.right[n] += right
            self.judged[n] += min(len(chain), right + 1, len(committed))
        n, chain = ngram_lookup(tokens, max_len, self.min_n, self.max_n)
        self.last = (len(tokens), n, chain) if chain else None
        return chain, (self.right[n] / self.judged[n] if chain else 0.0)
