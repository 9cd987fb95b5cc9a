"""Suffix decoding (Arctic Inference's SuffixDecoding, vLLM's `suffix` method): speculation that learns across
requests, with no model.

Two depth-limited suffix tries with occurrence counts propose the drafts: one per request over its prompt and
output so far (updated with the new tokens of each step: O(new tokens x depth), never rebuilt), and one per model
over the responses of recently finished requests (the shared cache, updated when a request finishes, bounded in
requests and in bytes, the oldest responses evicted whole). Each step, every suffix of the request's context (up
to `max_tree_depth` - 1 tokens) that recurs in a trie is a match, and the continuations seen after it make a draft
tree, expanded best first by their frequency-based path probability (a child's count over its siblings' total,
times its parent's): a node below `min_token_prob` is not drafted, and the tree has at most `max_spec_factor` x the
matched length nodes (a long match earns a long draft). The tree with the most expected accepted tokens (the sum
of its path probabilities), over both tries and every match, is the draft.

The drafts are deterministic (no q), so greedy verification keeps plain decoding's output and rejection sampling
over siblings keeps the target distribution, as for every method. With the cache scope `request`, or a request
that opts out (`SamplingParams.suffix_cache = False`), a request drafts from its own text only and its response is
never cached: no request is drafted another's text.
"""

from __future__ import annotations

import heapq
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

from specserve.checks import ConfigError, int_at_least
from specserve.speculative.base import DraftKind, MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.tree import Chain, DraftTree

SCOPES = ("model", "request")


class Node:
    """A trie node: the substring spelt by its root path, how often it occurs, and its continuations. A node with
    one child keeps it in `child` (most nodes of a trie over text that does not repeat have one); a second child
    moves them into the `children` dict."""

    __slots__ = ("count", "token", "child", "children")

    def __init__(self, token: int):
        self.count = 0
        self.token = token
        self.child: Node | None = None
        self.children: dict[int, Node] | None = None

    def get(self, token: int) -> Node | None:
        if self.children is not None:
            return self.children.get(token)
        child = self.child
        return child if child is not None and child.token == token else None

    def kids(self) -> list[Node]:
        if self.children is not None:
            return list(self.children.values())
        return [self.child] if self.child is not None else []


NODE_BYTES = sys.getsizeof(Node(0))  # one node object (its four slots and the GC header)
TOKEN_BYTES = 8 + 32  # a cached response's token: its list slot and, above 256, its int object


class SuffixTrie:
    """Every substring of at most `max_depth` tokens of the sequences added, with its number of occurrences.
    `bytes` counts the nodes and the child dicts the trie holds (what the shared cache caps)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node(-1)
        self.nodes = 1
        self.bytes = NODE_BYTES

    def extend(self, tail: list[Node], tokens: list[int], delta: int = 1) -> list[Node]:
        """Add (delta 1) or remove (-1) one occurrence of every substring ending at each of `tokens`, which follow
        the sequence whose suffix nodes (lengths 0, 1, ..., at most max_depth - 1) are `tail`; returns the new
        tail. O(len(tokens) x max_depth)."""
        depth_limit = self.max_depth
        for token in tokens:
            grown = [self.root]
            for node in tail:  # at most depth_limit nodes: `grown` stops there
                child = node.get(token)
                if child is None:
                    if delta < 0:
                        break  # never added: nothing below it either
                    child = self._add_child(node, token)
                child.count += delta
                if child.count <= 0:
                    self._remove_child(node, child)
                if len(grown) < depth_limit:
                    grown.append(child)
            tail = grown
        return tail

    def _add_child(self, node: Node, token: int) -> Node:
        child = Node(token)
        if node.children is None and node.child is None:
            node.child = child
        else:
            if node.children is None:
                node.children = {node.child.token: node.child}
                node.child = None
                self.bytes += sys.getsizeof(node.children)
            before = sys.getsizeof(node.children)
            node.children[token] = child
            self.bytes += sys.getsizeof(node.children) - before
        self.nodes += 1
        self.bytes += NODE_BYTES
        return child

    def _remove_child(self, node: Node, child: Node) -> None:
        """Unlink a child whose count reached 0 (its descendants' counts reach 0 in the same pass)."""
        if node.children is not None:
            del node.children[child.token]
            if not node.children:
                self.bytes -= sys.getsizeof(node.children)
                node.children = None
        elif node.child is child:
            node.child = None
        self.nodes -= 1
        self.bytes -= NODE_BYTES

    def matches(self, context: list[int]) -> list[tuple[Node, int]]:
        """(node, length) for each suffix of `context` shorter than max_depth that occurred followed by
        something, longest first. Shortest first, the walk stops at the first suffix that never occurred: no
        longer one did."""
        found = []
        for length in range(1, min(self.max_depth - 1, len(context)) + 1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.get(token)
                if node is None:
                    break
            if node is None:
                break
            if node.child is not None or node.children:
                found.append((node, length))
        return found[::-1]


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]  # node indices (0: the root), one per token
    score: float = 0.0  # expected accepted tokens: the sum of the nodes' path probabilities

    def tree(self, root: int) -> DraftTree:
        if all(parent == i for i, parent in enumerate(self.parents)):
            return Chain(root, self.tokens)
        return DraftTree([root] + self.tokens, [-1] + self.parents)


def grow_draft(start: Node, budget: int, min_prob: float, chain: bool = False) -> Draft:
    """The `budget` likeliest continuations below `start` (a tree, best first by path probability), none below
    `min_prob`; `chain`: only the most frequent child of each node (a chain)."""
    draft = Draft([], [])
    frontier: list[tuple[float, int, int, Node]] = []  # (-path probability, tie breaker, parent index, node)
    order = 0

    def push(parent_index: int, parent: Node, parent_prob: float) -> None:
        nonlocal order
        kids = parent.kids()
        total = sum(kid.count for kid in kids)
        for kid in [max(kids, key=lambda kid: kid.count)] if chain and kids else kids:
            order += 1
            heapq.heappush(frontier, (-parent_prob * kid.count / total, order, parent_index, kid))

    push(0, start, 1.0)
    while frontier and len(draft.tokens) < budget:
        neg_prob, _, parent_index, node = heapq.heappop(frontier)
        if -neg_prob < min_prob:
            break
        draft.tokens.append(node.token)
        draft.parents.append(parent_index)
        draft.score -= neg_prob
        push(len(draft.tokens), node, -neg_prob)
    return draft


def best_draft(matches, max_len: int, factor: float, min_prob: float, chain: bool = False) -> Draft:
    """The draft with the most expected accepted tokens over the matched suffixes (longest first): a long match
    earns a long draft but leaves the trie less depth below it, so each is tried (Arctic Inference does the same);
    a match whose budget cannot beat the best so far is skipped."""
    best = Draft([], [])
    for node, length in matches:
        budget = min(max_len, spec_budget(length, factor))
        if budget > best.score:
            draft = grow_draft(node, budget, min_prob, chain)
            if draft.score > best.score:
                best = draft
    return best


class ResponseCache:
    """A model's shared cache: the responses of recently finished requests in one trie, at most `max_requests`
    of them and `max_bytes` of trie and tokens; the oldest are evicted whole (their counts taken out again)."""

    CHUNK = 64  # response tokens added between checks of the memory cap

    def __init__(self, max_depth: int, max_requests: int, max_bytes: int):
        self.trie = SuffixTrie(max_depth)
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.responses: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.tokens = 0
        self.next_id = 0
        self.lock = threading.Lock()  # servers may finish requests of one model from more than one thread

    @property
    def bytes(self) -> int:
        return self.trie.bytes + self.tokens * TOKEN_BYTES

    def add(self, response: list[int]) -> None:
        """Cache a finished request's response, evicting the oldest to stay within the caps. It goes in a chunk
        at a time, with evictions between chunks, so memory passes the cap by one chunk at most; a response that
        does not fit alone is taken out again and not kept."""
        if not response or self.max_requests == 0:
            return
        response = list(response)
        with self.lock:
            while len(self.responses) >= self.max_requests:
                self._evict_oldest()
            self.tokens += len(response)
            tail = [self.trie.root]
            for start in range(0, len(response), self.CHUNK):
                tail = self.trie.extend(tail, response[start:start + self.CHUNK])
                while self.responses and self.bytes > self.max_bytes:
                    self._evict_oldest()
                if self.bytes > self.max_bytes:  # alone, it does not fit
                    self.trie.extend([self.trie.root], response[:start + self.CHUNK], delta=-1)
                    self.tokens -= len(response)
                    return
            self.next_id += 1
            self.responses[self.next_id] = response

    def _evict_oldest(self) -> None:
        _, response = self.responses.popitem(last=False)
        self.trie.extend([self.trie.root], response, delta=-1)
        self.tokens -= len(response)

    def clear(self) -> None:
        with self.lock:
            while self.responses:
                self._evict_oldest()

    def draft(self, context: list[int], max_len: int, factor: float, min_prob: float, chain: bool = False) -> Draft:
        with self.lock:
            return best_draft(self.trie.matches(context), max_len, factor, min_prob, chain)

    def stats(self) -> dict:
        return {"cached_requests": len(self.responses), "cached_tokens": self.tokens, "cache_bytes": self.bytes,
                "cache_nodes": self.trie.nodes}


def spec_budget(matched: int, factor: float) -> int:
    """Draft tokens a match of `matched` tokens earns (vLLM's max_spec_factor x match length)."""
    return int(matched * factor + 1e-6)


class SuffixProposer(Proposer):
    """One request: its own trie over prompt and output, grown by the tokens each call adds; the shared cache
    (None: scope `request` or the request opted out) for the responses of earlier requests."""

    def __init__(self, method: SuffixMethod, shared: ResponseCache | None):
        self.method, self.shared = method, shared
        self.trie = SuffixTrie(method.max_tree_depth)
        self.tail = [self.trie.root]
        self.seen = 0  # tokens of the context in self.trie

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        return Proposal(self.draft(tokens, max_len).tree(tokens[-1]))

    def draft(self, tokens: list[int], max_len: int, chain: bool = False) -> Draft:
        """The best draft from the request's own trie (brought up to `tokens` first) and the shared cache; `chain`:
        the best chain (a branch of an EAGLE tree)."""
        if len(tokens) > self.seen:
            self.tail = self.trie.extend(self.tail, tokens[self.seen:])
            self.seen = len(tokens)
        method = self.method
        best = self._own_draft(max_len, chain)
        if self.shared is not None:
            other = self.shared.draft(tokens, max_len, method.max_spec_factor, method.min_token_prob, chain)
            best = other if other.score > best.score else best
        return best

    def _own_draft(self, max_len: int, chain: bool) -> Draft:
        """From the request's own trie: its tail holds the nodes of the context's suffixes, so the matches need no
        walk."""
        matches = ((node, length) for length, node in reversed(list(enumerate(self.tail)))
                   if length and (node.child is not None or node.children))
        return best_draft(matches, max_len, self.method.max_spec_factor, self.method.min_token_prob, chain)

    def request_finished(self, output: list[int]) -> None:
        if self.shared is not None:
            self.shared.add(output)


class SuffixMethod(SpecMethod):
    name = "suffix"
    draft_kind = DraftKind.LOOKUP

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, cache_bytes: int = 256 * 2**20, cache_scope: str = "model"):
        self.max_tree_depth, self.max_spec_factor, self.min_token_prob = max_tree_depth, max_spec_factor, \
            min_token_prob
        self.cache_scope = cache_scope
        self.cache = ResponseCache(max_tree_depth, max_cached_requests, cache_bytes)

    def new_proposer(self, params, generator, capacity) -> Proposer:
        shares = self.cache_scope == "model" and params.suffix_cache
        return SuffixProposer(self, self.cache if shares else None)

    def reset(self) -> None:
        self.cache.clear()

    def stats(self) -> dict:
        return self.cache.stats()


@dataclass
class SuffixOptions(MethodOptions):
    suffix_decoding_max_tree_depth: int = 24  # the longest substring the tries hold (match + draft)
    suffix_decoding_max_cached_requests: int = 10000  # responses in the shared cache (0: no shared cache)
    suffix_decoding_max_spec_factor: float = 1.0  # draft tokens per matched token
    suffix_decoding_min_token_prob: float = 0.1  # the least path probability a drafted token may have
    suffix_cache_max_bytes: int = 256 * 2**20  # the shared cache's memory (trie and tokens)
    suffix_cache_scope: str = "model"  # model: requests draft from each other's responses; request: never
    KEYS: ClassVar[frozenset[str]] = frozenset({
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob", "suffix_cache_max_bytes", "suffix_cache_scope"})
    EXCLUSIVE: ClassVar[dict[str, str]] = {key: "suffix" for key in KEYS}

    @classmethod
    def read(cls, settings: dict) -> dict:
        out = {}
        for key, minimum in (("suffix_decoding_max_tree_depth", 2), ("suffix_decoding_max_cached_requests", 0),
                             ("suffix_cache_max_bytes", 1)):
            if key in settings:
                out[key] = int_at_least(settings[key], key, minimum)
        if "suffix_decoding_max_spec_factor" in settings:
            out["suffix_decoding_max_spec_factor"] = number_in(settings, "suffix_decoding_max_spec_factor", 0.0,
                                                               None, low_open=True)
        if "suffix_decoding_min_token_prob" in settings:
            out["suffix_decoding_min_token_prob"] = number_in(settings, "suffix_decoding_min_token_prob", 0.0, 1.0)
        if "suffix_cache_scope" in settings:
            out["suffix_cache_scope"] = cache_scope(settings["suffix_cache_scope"], "suffix_cache_scope")
        return out


def number_in(settings: dict, key: str, low: float, high: float | None, low_open: bool = False) -> float:
    value = settings[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(f"{key} must be a number {bounds}, got {value!r}")
    return float(value)


def cache_scope(value, key: str) -> str:
    if value not in SCOPES:
        raise ConfigError(f"{key} must be {' or '.join(SCOPES)}, got {value!r}")
    return value


def build(options: SuffixOptions, target) -> SuffixMethod:
    return SuffixMethod(options.suffix_decoding_max_tree_depth, options.suffix_decoding_max_cached_requests,
                        options.suffix_decoding_max_spec_factor, options.suffix_decoding_min_token_prob,
                        options.suffix_cache_max_bytes, options.suffix_cache_scope)


VLLM_KEYS = frozenset(key for key in SuffixOptions.KEYS if key.startswith("suffix_decoding_"))
SUFFIX = MethodEntry(SuffixMethod.name, SuffixOptions, build, aliases=("suffix_decoding",), trtllm="Suffix",
                     vllm=("suffix",), vllm_keys=VLLM_KEYS,
                     # its drafts are long where responses repeat (retries, agents): they need room to pay
                     fixed_draft_len=8, adaptive_draft_cap=16,
                     # vLLM drafts up to the tree depth when num_speculative_tokens is not given
                     vllm_default_draft_len=lambda settings: settings.get("suffix_decoding_max_tree_depth",
                                                                          SuffixOptions.suffix_decoding_max_tree_depth))
