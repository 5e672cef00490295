"""The count trie behind SuffixDecoding's drafts, in two implementations that give the
same drafts and node counts: C++ (``pagedllm/cpu/suffix_tree.cpp``, the torch class
``torch.classes.pagedllm_cpu.SuffixTree``), used when the CPU extension is built, and
:class:`PythonSuffixTree`, used otherwise. All lengths and depths are counted in tokens.

A tree holds sequences of token ids, each under the caller's integer id. For every
position ``q`` of every sequence it stores the string ``seq[q : q + depth]`` (shorter at
the sequence's end), all merged into one trie whose nodes count the stored strings
passing through them: the count of a path is the number of occurrences of that token
string in the sequences (strings never span two sequences). A growing sequence
(:meth:`SuffixTree.extend`) is updated in amortized O(depth) per appended token.

Drafting. For a match length ``m`` the draft starts where the path of the context's last
``m`` tokens ends, follows the child with the highest count (ties: the smaller token
id), each token carrying the probability ``prod(child count / parent count)`` along the
path, and stops before a token whose probability falls below ``min_prob``, at a leaf, or
at ``min(max_tokens, floor(factor * m))`` tokens. A draft's score is the sum of its
tokens' probabilities (the expected number of accepted tokens); the best score over
every ``m`` from 1 to ``depth - 1`` whose string is stored wins (ties: the longer match).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from pagedllm.cpu.extension import ops

_ROOT = 0
_NONE = -1

logger = logging.getLogger("pagedllm")


class SuffixTree(Protocol):
    """What both implementations offer. A draft is (tokens, score)."""

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one when unknown), which keeps
        growing: :meth:`draft_after` continues it."""

    def insert(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Store a whole sequence (a new id) that will not grow."""

    def remove(self, seq_id: int) -> None:
        """Remove every string of ``seq_id``, which must be the oldest sequence stored."""

    def draft_after(
        self, seq_id: int, max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The best draft after growing sequence ``seq_id``'s own last tokens."""

    def draft_matching(
        self, context: Sequence[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The best draft after ``context``'s last tokens, wherever the tree stores them."""

    def num_nodes(self) -> int:
        """Nodes held, not counting the root."""


def new_suffix_tree(depth: int, native: bool | None = None) -> SuffixTree:
    """A tree storing strings of up to ``depth`` tokens: the C++ one when ``native`` (None:
    when the CPU extension is built), else the Python one."""
    if native is None:
        native = ops() is not None
    if native:
        if ops() is None:
            raise RuntimeError("the C++ suffix tree needs the CPU extension, which is not built")
        return torch.classes.pagedllm_cpu.SuffixTree(depth)
    return PythonSuffixTree(depth)


class PythonSuffixTree:
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
        "_active",
        "_num_nodes",
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
        self._active: dict[int, list[int]] = {}  # growing sequences' active nodes
        self._num_nodes = 0  # not counting the root

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        for t in tokens:
            seq.append(int(t))
            self._append(seq_id, seq, active)

    def insert(self, seq_id: int, tokens: Sequence[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already stored")
        self.extend(seq_id, tokens)
        del self._active[seq_id]

    def draft_after(
        self, seq_id: int, max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        matches = [(node, self._len[node]) for node in reversed(self._active[seq_id])]
        return self._best_draft(matches, max_tokens, factor, min_prob)

    def draft_matching(
        self, context: Sequence[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        matches: list[tuple[int, int]] = []
        for m in range(1, min(len(context), self._depth - 1) + 1):
            found = self._match(context, m)
            if found is None:
                break  # a longer suffix contains this one: not stored either
            matches.append(found)
        return self._best_draft(matches, max_tokens, factor, min_prob)

    def num_nodes(self) -> int:
        return self._num_nodes

    def _append(self, seq_id: int, seq: list[int], active: list[int]) -> None:
        """Store the strings that the last token of ``seq`` extends or starts.
        ``active`` holds the nodes where the sequence's unfinished strings (shorter
        than ``depth``) end, longest first, and is updated in place, so that
        ``active[-m]`` is the node of the sequence's last ``m`` tokens."""
        p = len(seq) - 1
        t = seq[p]
        self._count[_ROOT] += 1
        active.append(_ROOT)
        active[:] = [self._step(node, seq_id, p, t) for node in active]
        if len(active) == self._depth:
            del active[0]  # that string has reached the depth

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
        self._active.pop(seq_id, None)

    def _match(self, tokens: Sequence[int], m: int) -> tuple[int, int] | None:
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

    def _draft(self, node: int, idx: int, limit: int, min_prob: float) -> tuple[list[int], float]:
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

    def _best_draft(
        self, matches: list[tuple[int, int]], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The best-scoring draft over ``matches[m - 1]`` = (node, offset) of match
        length ``m``; ties go to the longer match."""
        best: list[int] = []
        best_score = 0.0
        for m, (node, idx) in enumerate(matches, 1):
            limit = min(max_tokens, int(m * factor + 1e-6))
            if limit > 0:
                out, score = self._draft(node, idx, limit, min_prob)
                if score >= best_score:
                    best, best_score = out, score
        return best, best_score

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
        self._num_nodes += 1
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
        self._num_nodes -= 1
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
        self._replace_child(node, t, child, upper)
        return upper

    def _merge(self, node: int, child: int) -> None:
        """Fold ``node`` into its only child of equal count; no string ends at node."""
        parent = self._parent[node]
        t = self._seqs[self._seq[node]][self._pos[node]]
        self._pos[child] -= self._len[node]
        self._len[child] += self._len[node]
        self._parent[child] = parent
        self._replace_child(parent, t, node, child)
        self._free_node(node)

    def _replace_child(self, node: int, t: int, old: int, new: int) -> None:
        """``new`` takes ``old``'s place as ``node``'s child ``t`` (and as its best)."""
        kids = self._children[node]
        assert kids is not None
        kids[t] = new
        if self._best[node] == old:
            self._best[node] = new

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
