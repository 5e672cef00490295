"""SuffixDecoding: draft tokens from suffix trees over a request's own tokens and over
the outputs of earlier requests.

Modelled on SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications") as Arctic Inference implements it for vLLM; pure Python.
All lengths and depths are counted in tokens.

Trees. A tree holds sequences of token ids. For every position ``q`` of every sequence
it stores the string ``seq[q : q + max_tree_depth]`` (shorter at the sequence's end),
all merged into one trie whose nodes count the stored strings passing through them: the
count of a path is the number of occurrences of that token string in the sequences
(strings never span two sequences). Each request has a tree over its prompt and output
so far, updated with the tokens appended since its previous proposal (amortized
O(max_tree_depth) per token). The global tree holds the outputs, not the prompts, of the
last ``max_cached_requests`` finished requests (those with at least one output token);
finishing one more evicts the least recently finished one's output whole.

Drafts. For each match length ``m`` from 1 to ``min(len(token_ids), max_tree_depth - 1)``
the last ``m`` tokens are looked up in a tree; from the node reached, the draft follows
the child with the highest count (ties: the smaller token id), each token carrying the
probability ``prod(child count / parent count)`` along the path, and stops before a
token whose probability falls below ``min_token_prob``, at a leaf, or at
``min(max_tokens, floor(max_spec_factor * m))`` tokens. A draft's score is the sum of
its tokens' probabilities (the expected number of accepted tokens); the best score over
all ``m`` wins (ties: the longer match), first within each tree, then between the
request's tree and the global tree (ties: the request's). A match and its draft together
never exceed ``max_tree_depth`` tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT = 0
_NONE = -1


@dataclass(frozen=True)
class SuffixConfig:
    """Knobs of :class:`SuffixProposer`."""

    max_tree_depth: int = 24
    """Longest string (tokens) stored per position; bounds match length + draft length
    (so 1 never drafts)."""
    max_cached_requests: int = 10000
    """Finished requests whose outputs the global tree keeps (0: no global tree)."""
    max_spec_factor: float = 1.0
    """A draft has at most ``floor(max_spec_factor * match length)`` tokens."""
    min_token_prob: float = 0.1
    """The draft stops before a token whose path probability is below this."""

    def __post_init__(self) -> None:
        for name in ("max_tree_depth", "max_cached_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be positive, got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise ValueError(
                f"max_cached_requests must be non-negative, got {self.max_cached_requests}"
            )
        if not self.max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be positive, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


class _SuffixTree:
    """A path-compressed count trie of every sequence's strings of up to ``depth``
    tokens, one per start position.

    Nodes are ints indexing parallel lists (no per-node Python objects: the garbage
    collector never walks them); node 0 is the root, whose count is the number of
    stored strings. A node holds a run of ``length`` tokens, read from its reference
    ``seqs[seq][pos : pos + length]``, and the count shared by the whole run.
    Invariants:

    * every stored string ends at the end of a node;
    * canonical compression: no node but the root has a single child of equal count
      (node boundaries lie exactly where the trie branches or a stored string ends);
    * the reference is an occurrence of the node's whole path: the path's tokens end
      at ``seqs[seq][pos + length - 1]``;
    * the reference's sequence is the newest sequence whose strings pass through the
      node (each string entering a node re-points it), so removing the oldest
      sequence, the only removal there is, leaves no reference to it;
    * ``best[node]`` is the child with the highest count (ties: the smaller first
      token), for every node but the root.
    """

    __slots__ = (
        "_depth",
        "_seqs",
        "_count",
        "_seq",
        "_pos",
        "_len",
        "_parent",
        "_best",
        "_children",
        "_free",
        "num_nodes",
    )

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._seqs: dict[int, list[int]] = {}
        self._count = [0]
        self._seq = [0]
        self._pos = [0]
        self._len = [0]
        self._parent = [_NONE]
        self._best = [_NONE]
        # first token of each child -> child; None for a leaf (int-only dicts stay
        # untracked by the garbage collector)
        self._children: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        self.num_nodes = 0  # not counting the root

    def add_sequence(self, seq_id: int, tokens: list[int]) -> None:
        """Store an empty sequence; :meth:`append` then adds its tokens in order."""
        self._seqs[seq_id] = tokens

    def append(self, seq_id: int, active: list[int]) -> list[int]:
        """Store the strings that the last token of ``seqs[seq_id]`` extends or starts.

        ``active`` holds the nodes where the sequence's unfinished strings (shorter
        than ``depth``) end, longest first; the updated list comes back, so that
        ``active[-m]`` is the node of the sequence's last ``m`` tokens."""
        tokens = self._seqs[seq_id]
        p = len(tokens) - 1
        t = tokens[p]
        self._count[_ROOT] += 1
        active.append(_ROOT)
        stepped = [self._step(node, seq_id, p, t) for node in active]
        if len(stepped) == self._depth:
            del stepped[0]  # that string has reached the depth
        return stepped

    def insert(self, seq_id: int, tokens: list[int]) -> None:
        """Store a whole sequence."""
        seq: list[int] = []
        self.add_sequence(seq_id, seq)
        active: list[int] = []
        for t in tokens:
            seq.append(t)
            active = self.append(seq_id, active)

    def remove(self, seq_id: int) -> None:
        """Remove every string of ``seq_id``, which must be the oldest sequence."""
        tokens = self._seqs[seq_id]
        count, length, children, best = self._count, self._len, self._children, self._best
        stale: set[int] = set()  # nodes whose best child lost count
        n = len(tokens)
        for q in range(n):
            end = min(self._depth, n - q)
            count[_ROOT] -= 1
            node, d = _ROOT, 0
            while d < end:
                kids = children[node]
                assert kids is not None
                child = kids[tokens[q + d]]
                count[child] -= 1
                if node != _ROOT and best[node] == child:
                    stale.add(node)
                if count[child] == 0:
                    self._drop(node, tokens[q + d])
                    break
                node = child
                d += length[child]
            # node lost its ending string or a child: it may now hold a single child of
            # its own count (elsewhere on the path both sides lost the same count)
            kids = children[node]
            if node != _ROOT and kids is not None and len(kids) == 1:
                (child,) = kids.values()
                if count[child] == count[node]:
                    self._merge(node, child)
        for node in stale:
            if count[node] > 0:  # neither dropped nor merged away
                best[node] = self._max_child(node)
        del self._seqs[seq_id]

    def match(self, tokens: Sequence[int], m: int) -> tuple[int, int] | None:
        """The node and offset in its run where the path of ``tokens[-m:]`` ends, or
        None when those tokens are not stored."""
        seqs, seq, pos, length, children = (
            self._seqs,
            self._seq,
            self._pos,
            self._len,
            self._children,
        )
        node, idx = _ROOT, 0
        for i in range(len(tokens) - m, len(tokens)):
            t = tokens[i]
            if idx == length[node]:
                kids = children[node]
                node = _NONE if kids is None else kids.get(t, _NONE)
                if node == _NONE:
                    return None
                idx = 1
            elif seqs[seq[node]][pos[node] + idx] == t:
                idx += 1
            else:
                return None
        return node, idx

    def draft(self, node: int, idx: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation (at most ``limit`` tokens) after offset ``idx``
        of ``node``'s run, and its score."""
        count, best, length = self._count, self._best, self._len
        ref = self._seqs[self._seq[node]]
        start = self._pos[node]
        out: list[int] = []
        prob = 1.0
        score = 0.0
        while len(out) < limit:
            if idx == length[node]:
                child = best[node]
                if child == _NONE:
                    break
                prob *= count[child] / count[node]
                if prob < min_prob:
                    break
                node, idx = child, 0
                ref = self._seqs[self._seq[node]]
                start = self._pos[node]
            out.append(ref[start + idx])
            score += prob
            idx += 1
        return out, score

    def best_draft(
        self, matches: list[tuple[int, int]], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The best-scoring draft over ``matches[m - 1]`` = (node, offset) of match
        length ``m``; ties go to the longer match."""
        best: list[int] = []
        best_score = 0.0
        for m, (node, idx) in enumerate(matches, 1):
            limit = min(max_tokens, int(m * factor + 1e-6))
            if limit > 0:
                out, score = self.draft(node, idx, limit, min_prob)
                if score >= best_score:
                    best, best_score = out, score
        return best, best_score

    def node_end(self, node: int) -> int:
        """The offset just past ``node``'s run."""
        return self._len[node]

    def _step(self, node: int, seq_id: int, p: int, t: int) -> int:
        """Extend the string ending at ``node`` by token ``t`` (at position ``p`` of
        ``seq_id``); the node where it ends now."""
        count = self._count
        kids = self._children[node]
        child = _NONE if kids is None else kids.get(t, _NONE)
        if child == _NONE:
            if node != _ROOT and count[node] == 1:
                # only this string reaches node: a leaf whose reference is this very
                # string, so its run grows in place
                self._len[node] += 1
                return node
            child = self._new_node(seq_id, p, node, 1, 1)
            if kids is None:
                self._children[node] = {t: child}
            else:
                kids[t] = child
        else:
            if self._len[child] > 1:
                child = self._split(node, child, t)
            count[child] += 1
            self._seq[child] = seq_id
            self._pos[child] = p
        if node != _ROOT:
            if count[child] == count[node]:
                self._merge(node, child)  # the last string ending at node left it
            else:
                self._raise_best(node, child, t)
        return child

    def _raise_best(self, node: int, child: int, t: int) -> None:
        """``child`` (first token ``t``) of ``node`` gained count."""
        best = self._best[node]
        if best == child:
            return
        if best == _NONE:
            self._best[node] = child
            return
        c, b = self._count[child], self._count[best]
        if c > b or (c == b and t < self._seqs[self._seq[best]][self._pos[best]]):
            self._best[node] = child

    def _max_child(self, node: int) -> int:
        kids = self._children[node]
        if kids is None:
            return _NONE
        count = self._count
        return max(kids.items(), key=lambda kv: (count[kv[1]], -kv[0]))[1]

    def _new_node(self, seq_id: int, pos: int, parent: int, count: int, length: int) -> int:
        self.num_nodes += 1
        if self._free:
            node = self._free.pop()
            self._count[node] = count
            self._seq[node] = seq_id
            self._pos[node] = pos
            self._len[node] = length
            self._parent[node] = parent
            return node
        self._count.append(count)
        self._seq.append(seq_id)
        self._pos.append(pos)
        self._len.append(length)
        self._parent.append(parent)
        self._best.append(_NONE)
        self._children.append(None)
        return len(self._count) - 1

    def _free_node(self, node: int) -> None:
        self.num_nodes -= 1
        self._count[node] = 0
        self._best[node] = _NONE
        self._children[node] = None
        self._free.append(node)

    def _split(self, node: int, child: int, t: int) -> int:
        """Cut ``child``'s run after its first token; the new upper node."""
        ref = self._seqs[self._seq[child]]
        pos = self._pos[child]
        upper = self._new_node(self._seq[child], pos, node, self._count[child], 1)
        self._children[upper] = {ref[pos + 1]: child}
        self._best[upper] = child
        self._pos[child] = pos + 1
        self._len[child] -= 1
        self._parent[child] = upper
        kids = self._children[node]
        assert kids is not None
        kids[t] = upper
        if self._best[node] == child:
            self._best[node] = upper
        return upper

    def _merge(self, node: int, child: int) -> None:
        """Fold ``node`` into its only child of equal count; no string ends at node."""
        parent = self._parent[node]
        t = self._seqs[self._seq[node]][self._pos[node]]
        self._pos[child] -= self._len[node]
        self._len[child] += self._len[node]
        self._parent[child] = parent
        kids = self._children[parent]
        assert kids is not None
        kids[t] = child
        if self._best[parent] == node:
            self._best[parent] = child
        self._free_node(node)

    def _drop(self, node: int, t: int) -> None:
        """Delete ``node``'s child ``t`` and its subtree, a chain whose counts are 0."""
        kids = self._children[node]
        assert kids is not None
        child = kids.pop(t)
        if not kids:
            self._children[node] = None
        while child != _NONE:
            below = self._children[child]
            self._free_node(child)
            child = _NONE if below is None else next(iter(below.values()))


class _Request:
    """A request's tokens so far and its tree over them."""

    __slots__ = ("tree", "tokens", "active", "num_prompt_tokens")

    def __init__(self, depth: int, num_prompt_tokens: int) -> None:
        self.tree = _SuffixTree(depth)
        self.tokens: list[int] = []
        self.tree.add_sequence(0, self.tokens)
        self.active: list[int] = []
        self.num_prompt_tokens = num_prompt_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        n = len(self.tokens)
        if len(token_ids) < n:
            raise ValueError(
                f"token_ids shrank from {n} to {len(token_ids)} tokens between proposals"
            )
        for t in token_ids[n:]:
            self.tokens.append(int(t))
            self.active = self.tree.append(0, self.active)


class SuffixProposer:
    """Draft tokens for running requests from their own tokens and from the outputs of
    finished requests (see the module docstring)."""

    def __init__(self, config: SuffixConfig) -> None:
        self._config = config
        self._requests: dict[str, _Request] = {}
        self._global = _SuffixTree(config.max_tree_depth) if config.max_cached_requests else None
        self._cached: deque[int] = deque()  # global sequence ids, least recently finished first
        self._next_seq_id = 0

    def propose(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int
    ) -> list[int]:
        """Up to max_tokens draft tokens to follow token_ids (prompt + output so far of
        request_id). The per-request tree is created on first call and updated
        incrementally with the tokens appended since the previous call (token_ids only
        grows between calls of one request, except that it may be called again with the
        same tokens). max_tokens <= 0 returns [] (after the update: a last call with 0
        brings the tree up to date before :meth:`finish`). num_prompt_tokens is read on
        the first call only."""
        request = self._requests.get(request_id)
        if request is None:
            if num_prompt_tokens < 0:
                raise ValueError(f"num_prompt_tokens must be non-negative, got {num_prompt_tokens}")
            request = _Request(self._config.max_tree_depth, num_prompt_tokens)
            self._requests[request_id] = request
        request.extend(token_ids)
        if max_tokens <= 0:
            return []
        factor, min_prob = self._config.max_spec_factor, self._config.min_token_prob
        tree = request.tree
        local = [(node, tree.node_end(node)) for node in reversed(request.active)]
        draft, score = tree.best_draft(local, max_tokens, factor, min_prob)
        if self._global is not None and self._cached:
            tokens = request.tokens
            matches: list[tuple[int, int]] = []
            for m in range(1, min(len(tokens), self._config.max_tree_depth - 1) + 1):
                found = self._global.match(tokens, m)
                if found is None:
                    break  # a longer suffix contains this one: not stored either
                matches.append(found)
            global_draft, global_score = self._global.best_draft(
                matches, max_tokens, factor, min_prob
            )
            if global_score > score:
                draft = global_draft
        return draft

    def finish(self, request_id: str) -> None:
        """The request ended: drop its per-request tree, add its output tokens (not the
        prompt; those seen by the last :meth:`propose`) to the global tree, evicting the
        least recently finished requests' outputs beyond max_cached_requests. Unknown
        ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.add_output(request.tokens[request.num_prompt_tokens :])

    def add_output(self, output: Sequence[int]) -> None:
        """Add a finished request's output tokens to the global tree (as :meth:`finish`
        does), for a request never proposed for: no per-request tree is built."""
        if self._global is None or not output:
            return
        output = [int(t) for t in output]
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._global.insert(seq_id, output)
        self._cached.append(seq_id)
        while len(self._cached) > self._config.max_cached_requests:
            self._global.remove(self._cached.popleft())

    def abort(self, request_id: str) -> None:
        """Drop the request's tree without adding it to the global tree."""
        self._requests.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        """Requests with a per-request tree (proposed for, not finished or aborted)."""
        return len(self._requests)

    @property
    def num_nodes(self) -> int:
        """Tree nodes held, over all per-request trees and the global tree."""
        tracked = sum(request.tree.num_nodes for request in self._requests.values())
        return tracked + (self._global.num_nodes if self._global is not None else 0)
