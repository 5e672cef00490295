"""SuffixProposer (pagedllm.spec_decode.suffix): drafts from the request's own tokens and
from earlier outputs, draft-length and probability limits, eviction, and a brute-force
oracle that recounts every occurrence in the histories for random workloads. Every test
runs on both trees, the Python one and the C++ one."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.cpu.extension import ops
from pagedllm.spec_decode import suffix
from pagedllm.spec_decode.suffix import SuffixConfig, SuffixProposer
from pagedllm.spec_decode.suffix_tree import new_suffix_tree


@pytest.fixture(autouse=True, scope="module", params=["python", "native"])
def tree_implementation(request: pytest.FixtureRequest):
    """The trees every proposer in the test builds (the C++ ones need the CPU extension)."""
    native = request.param == "native"
    if native and ops() is None:
        pytest.skip("the CPU extension is not built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            suffix, "new_suffix_tree", lambda depth, _=None: new_suffix_tree(depth, native)
        )
        yield request.param


# --- brute-force oracle -----------------------------------------------------------


def _occurrences(histories: Sequence[Sequence[int]], s: Sequence[int]) -> int:
    s = list(s)
    return sum(
        1 for h in histories for i in range(len(h) - len(s) + 1) if list(h[i : i + len(s)]) == s
    )


def _next_tokens(histories: Sequence[Sequence[int]], s: Sequence[int]) -> Counter[int]:
    s = list(s)
    return Counter(
        h[i + len(s)]
        for h in histories
        for i in range(len(h) - len(s))
        if list(h[i : i + len(s)]) == s
    )


def _oracle_tree(
    histories: Sequence[Sequence[int]],
    context: Sequence[int],
    config: SuffixConfig,
    max_tokens: int,
) -> tuple[list[int], float]:
    """The documented draft rule, recounting occurrences for every step."""
    depth = config.max_tree_depth
    best: list[int] = []
    best_score = 0.0
    for m in range(1, min(len(context), depth - 1) + 1):
        path = list(context[-m:])
        if _occurrences(histories, path) == 0:
            break
        limit = min(max_tokens, int(m * config.max_spec_factor + 1e-6))
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and len(path) < depth:
            nexts = _next_tokens(histories, path)
            if not nexts:
                break
            token = max(nexts, key=lambda a: (nexts[a], -a))
            prob *= nexts[token] / _occurrences(histories, path)
            if prob < config.min_token_prob:
                break
            out.append(token)
            score += prob
            path.append(token)
        if limit > 0 and score >= best_score:
            best, best_score = out, score
    return best, best_score


def _oracle(
    context: Sequence[int],
    cached_outputs: Sequence[Sequence[int]],
    config: SuffixConfig,
    max_tokens: int,
) -> list[int]:
    if max_tokens <= 0:
        return []
    local, local_score = _oracle_tree([context], context, config, max_tokens)
    if not cached_outputs:
        return local
    glob, global_score = _oracle_tree(cached_outputs, context, config, max_tokens)
    return glob if global_score > local_score else local


def _canonical_nodes(histories: Sequence[Sequence[int]], depth: int) -> int:
    """Nodes of the path-compressed trie of all strings of up to depth tokens: one per
    stored string where the trie branches or a stored string ends."""
    counts: Counter[tuple[int, ...]] = Counter()
    for h in histories:
        for i in range(len(h)):
            for n in range(1, min(depth, len(h) - i) + 1):
                counts[tuple(h[i : i + n])] += 1
    extensions: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for s in counts:
        extensions.setdefault(s[:-1], []).append(s)
    return sum(
        1
        for s, c in counts.items()
        if not (len(extensions.get(s, [])) == 1 and counts[extensions[s][0]] == c)
    )


# --- behaviour ----------------------------------------------------------------------


def test_repeated_prompt_phrase_gets_its_continuation() -> None:
    phrase = list(range(100, 111))
    prompt = [1, 2, 3, *phrase, 4, 5, 6]
    proposer = SuffixProposer(SuffixConfig())
    output = phrase[:4]
    # match of 4 tokens -> at most 4 tokens (max_spec_factor 1); probability 1/2: the
    # phrase's start occurs twice (prompt and the output's end), once followed
    assert proposer.propose("r", prompt + output, len(prompt), 8) == phrase[4:8]
    assert proposer.propose("r", prompt + output, len(prompt), 2) == phrase[4:6]
    assert proposer.num_tracked_requests == 1


def test_agentic_json_shape_comes_from_earlier_outputs() -> None:
    # '{"name": "get_weather", "arguments": {"city": "<city>"}}' as tokens
    head = [900, 901, 902, 903, 904, 905, 906, 907, 908, 909]  # up to '"city": "'
    tail = [910, 911, 912]  # '"}}'
    proposer = SuffixProposer(SuffixConfig())
    rng = random.Random(0)
    for i in range(64):
        prompt = [rng.randrange(1000, 30000) for _ in range(40)]
        output = [*head, 2000 + i, *tail]
        assert proposer.propose(f"call{i}", prompt + output, len(prompt), 0) == []
        proposer.finish(f"call{i}")
    assert proposer.num_tracked_requests == 0

    prompt = [rng.randrange(30000, 32000) for _ in range(40)]
    # a 3-token match drafts 3 tokens
    assert proposer.propose("new", prompt + head[:3], 40, 8) == head[3:6]
    # a 7-token match would allow 7, but the city differs in each of the 64 outputs
    # (probability 1/64 < min_token_prob): the draft stops before it
    assert proposer.propose("new", prompt + head[:7], 40, 8) == head[7:10]
    # after a city never seen nothing matches; after a known one the tail follows
    assert proposer.propose("unseen", [*prompt, *head, 5555], 40, 8) == []
    assert proposer.propose("seen", [*prompt, *head, 2007], 40, 8) == tail


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("max_tokens", [3, 100])
def test_draft_length_follows_match_length(factor: float, max_tokens: int) -> None:
    phrase = list(range(1000, 1040))
    config = SuffixConfig(max_tree_depth=64, max_spec_factor=factor)
    proposer = SuffixProposer(config)
    for m in range(1, 12):
        proposal = proposer.propose("r", [*phrase, 7, *phrase[:m]], 40, max_tokens)
        assert proposal == phrase[m : m + min(max_tokens, int(factor * m))]


def test_match_plus_draft_stay_within_the_tree_depth() -> None:
    phrase = list(range(1000, 1040))
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=8))
    # stored strings have 8 tokens: the 5-token match leaves 3 to draft, the 4-token
    # match 4 (the better score), the 3-token match is allowed only 3
    assert proposer.propose("r", [*phrase, 7, *phrase[:5]], 40, 100) == phrase[5:9]


def test_min_token_prob_stops_a_branchy_path() -> None:
    def proposer_with_branches(min_token_prob: float) -> SuffixProposer:
        proposer = SuffixProposer(SuffixConfig(max_spec_factor=2.0, min_token_prob=min_token_prob))
        for i in range(5):  # 7 8 9 is always followed by one of five tokens
            proposer.propose(f"o{i}", [1, 7, 8, 9, 20 + i], 1, 0)
            proposer.finish(f"o{i}")
        return proposer

    assert proposer_with_branches(0.3).propose("r", [50, 7, 8], 1, 10) == [9]
    # probability 1/5 passes 0.1; ties go to the smaller token
    assert proposer_with_branches(0.1).propose("r", [50, 7, 8], 1, 10) == [9, 20]


def test_the_most_frequent_continuation_wins() -> None:
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=3.0))
    for i, tail in enumerate([[30, 31], [40, 41], [40, 42], [40, 41]]):
        proposer.propose(f"o{i}", [1, 5, 6, *tail], 1, 0)
        proposer.finish(f"o{i}")
    # after 5 6: 40 three times out of four, then 41 twice out of three
    assert proposer.propose("r", [2, 5, 6], 1, 10) == [40, 41]
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=3.0, min_token_prob=0.6))
    for i, tail in enumerate([[30, 31], [40, 41], [40, 42], [40, 41]]):
        proposer.propose(f"o{i}", [1, 5, 6, *tail], 1, 0)
        proposer.finish(f"o{i}")
    assert proposer.propose("r", [2, 5, 6], 1, 10) == [40]  # 3/4 * 2/3 = 1/2 < 0.6


def test_the_better_score_picks_the_tree_and_ties_go_to_the_request() -> None:
    proposer = SuffixProposer(SuffixConfig())
    for i, output in enumerate([[5, 6, 40, 41], [5, 6]]):
        proposer.propose(f"o{i}", [1, *output], 1, 0)
        proposer.finish(f"o{i}")
    # both trees: 5 6 seen twice, continued once (probability 1/2, two tokens)
    assert proposer.propose("tie", [5, 6, 30, 9, 5, 6], 6, 2) == [30, 9]
    proposer.propose("o2", [1, 5, 6, 40, 41], 1, 0)
    proposer.finish("o2")
    # the global tree now continues 5 6 two times out of three
    assert proposer.propose("global", [5, 6, 30, 9, 5, 6], 6, 2) == [40, 41]


def test_eviction_reelects_the_most_frequent_child() -> None:
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=2))
    for i, output in enumerate([[5, 6, 5, 6], [5, 9], [5, 8]]):
        proposer.propose(f"o{i}", [0, *output], 1, 0)
        proposer.finish(f"o{i}")
        if i == 1:
            assert proposer.propose("before", [0, 5], 1, 1) == [6]  # 2 of 3
    # 6 left with the first output; 8 and 9 tie: the smaller token
    assert proposer.propose("after", [0, 5], 1, 1) == [8]


def test_only_outputs_join_the_global_tree() -> None:
    proposer = SuffixProposer(SuffixConfig())
    phrase = list(range(100, 110))
    proposer.propose("a", [*phrase, 1, 2, 3], 10, 0)
    proposer.finish("a")
    assert proposer.propose("b", [7, *phrase[:4]], 1, 5) == []  # the prompt is not kept
    assert proposer.propose("c", [7, 1, 2], 1, 5) == [3]


def test_an_output_added_without_a_tree_serves_like_a_finished_one() -> None:
    """add_output: a request never proposed for joins the global tree by its output
    alone (no per-request tree is built for it)."""
    proposer = SuffixProposer(SuffixConfig())
    proposer.add_output([1, 2, 3, 4, 5])
    assert proposer.num_tracked_requests == 0
    assert proposer.propose("b", [9, 9, 1, 2], 2, 3) == [3, 4]  # match 2: at most 2


def test_abort_keeps_nothing_and_unknown_ids_are_ignored() -> None:
    proposer = SuffixProposer(SuffixConfig())
    proposer.propose("a", [1, 2, 3, 4, 5], 1, 0)
    assert proposer.num_tracked_requests == 1 and proposer.num_nodes > 0
    proposer.abort("a")
    assert proposer.num_tracked_requests == 0 and proposer.num_nodes == 0
    proposer.finish("a")
    proposer.abort("never-seen")
    assert proposer.propose("b", [9, 2, 3], 1, 5) == []


def test_eviction_drops_the_least_recently_finished_output() -> None:
    config = SuffixConfig(max_cached_requests=2)
    proposer = SuffixProposer(config)
    outputs = {"a": [1, 2, 3, 4, 5, 6], "b": [11, 12, 13, 14, 15, 16], "c": [21, 22, 23, 24]}

    def finish(request_id: str) -> None:
        proposer.propose(request_id, [0, *outputs[request_id]], 1, 0)
        proposer.finish(request_id)

    finish("a")
    finish("b")
    assert proposer.propose("q1", [99, 1, 2, 3], 1, 3) == [4, 5, 6]
    finish("c")
    assert proposer.propose("q2", [99, 1, 2, 3], 1, 3) == []
    assert proposer.propose("q3", [99, 11, 12, 13], 1, 3) == [14, 15, 16]
    # the global tree now holds exactly b and c
    for request_id in ("q1", "q2", "q3"):
        proposer.abort(request_id)
    fresh = SuffixProposer(config)
    for request_id in ("b", "c"):
        fresh.propose(request_id, [0, *outputs[request_id]], 1, 0)
        fresh.finish(request_id)
    assert proposer.num_nodes == fresh.num_nodes > 0


def test_memory_stays_bounded_under_eviction() -> None:
    rng = random.Random(1)
    config = SuffixConfig(max_tree_depth=6, max_cached_requests=3)
    proposer = SuffixProposer(config)
    outputs = []
    for i in range(200):
        output = [rng.randrange(8) for _ in range(rng.randrange(1, 30))]
        outputs.append(output)
        proposer.propose(str(i), [99, *output], 1, 0)
        proposer.finish(str(i))
        assert proposer.num_nodes == _canonical_nodes(outputs[-3:], 6)
    assert proposer.num_nodes <= 3 * 29 * 2


def test_no_global_tree_when_nothing_is_cached() -> None:
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=0))
    proposer.propose("a", [5, 1, 2, 3], 1, 0)
    proposer.finish("a")
    assert proposer.num_nodes == 0
    assert proposer.propose("b", [7, 1, 2], 1, 5) == []


def test_max_tokens_zero_still_updates_and_shrinking_tokens_are_refused() -> None:
    proposer = SuffixProposer(SuffixConfig())
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2], 0, 0) == []
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2], 0, -1) == []
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2], 0, 4) == [3, 4]
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2], 0, 4) == [3, 4]  # same tokens again
    with pytest.raises(ValueError, match="shrank"):
        proposer.propose("r", [1, 2, 3], 0, 4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tree_depth", 0),
        ("max_tree_depth", 2.5),
        ("max_cached_requests", -1),
        ("max_spec_factor", 0.0),
        ("max_spec_factor", float("nan")),
        ("min_token_prob", -0.1),
        ("min_token_prob", 1.5),
    ],
)
def test_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**{field: value})


def test_long_sequences_update_incrementally() -> None:
    # performance sanity, not timed: a 4,000-token request with a global tree, then
    # one token at a time; every draft continues an earlier occurrence
    rng = random.Random(2)
    proposer = SuffixProposer(SuffixConfig())
    for i in range(50):
        proposer.propose(f"o{i}", [rng.randrange(32000) for _ in range(200)], 100, 0)
        proposer.finish(f"o{i}")
    base = [rng.randrange(32000) for _ in range(3000)]
    tokens = base + base[:1000]
    proposer.propose("r", tokens, 3000, 5)
    for i in range(300):
        tokens.append(base[1000 + i])
        assert proposer.propose("r", tokens, 3000, 5) == base[1001 + i : 1006 + i]


# --- random workloads against the oracle ------------------------------------------

_configs = st.builds(
    SuffixConfig,
    max_tree_depth=st.integers(1, 7),
    max_cached_requests=st.integers(0, 3),
    max_spec_factor=st.sampled_from([0.5, 1.0, 1.5, 3.0]),
    min_token_prob=st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]),
)
_tokens = st.lists(st.integers(0, 3), max_size=8)
_ops = st.lists(
    st.tuples(
        st.sampled_from(["grow", "grow", "grow", "finish", "abort"]),
        st.integers(0, 2),  # request slot
        _tokens,
        st.integers(-1, 6),  # max_tokens
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(config=_configs, ops=_ops)
def test_random_workloads_match_the_oracle(config: SuffixConfig, ops: list) -> None:
    proposer = SuffixProposer(config)
    running: dict[str, tuple[list[int], int]] = {}  # tokens seen, prompt length
    cached: list[list[int]] = []
    generation = [0, 0, 0]  # a slot's request ids are never reused
    for op, slot, new_tokens, max_tokens in ops:
        request_id = f"{slot}.{generation[slot]}"
        if op == "grow":
            tokens, num_prompt = running.get(request_id, ([], len(new_tokens)))
            tokens = tokens + new_tokens
            running[request_id] = (tokens, num_prompt)
            proposal = proposer.propose(request_id, tokens, num_prompt, max_tokens)
            assert proposal == _oracle(tokens, cached, config, max_tokens)
        else:  # unknown ids (never grown) are ignored
            tokens, num_prompt = running.pop(request_id, ([], 0))
            if op == "finish":
                proposer.finish(request_id)
                if config.max_cached_requests and tokens[num_prompt:]:
                    cached = [*cached, tokens[num_prompt:]][-config.max_cached_requests :]
            else:
                proposer.abort(request_id)
            generation[slot] += 1
        expected_nodes = _canonical_nodes(cached, config.max_tree_depth) + sum(
            _canonical_nodes([tokens], config.max_tree_depth) for tokens, _ in running.values()
        )
        assert proposer.num_nodes == expected_nodes
        assert proposer.num_tracked_requests == len(running)


@settings(max_examples=200, deadline=None)
@given(
    config=_configs,
    history=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), max_size=4),
    stream=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    max_tokens=st.integers(1, 6),
)
def test_proposals_are_sound_and_incremental_equals_scratch(
    config: SuffixConfig,
    history: list[list[int]],
    stream: list[int],
    max_tokens: int,
) -> None:
    def with_history() -> SuffixProposer:
        proposer = SuffixProposer(config)
        for i, output in enumerate(history):
            proposer.propose(f"h{i}", [9, *output], 1, 0)
            proposer.finish(f"h{i}")
        return proposer

    cached = history[-config.max_cached_requests :] if config.max_cached_requests else []
    incremental = with_history()
    for n in range(1, len(stream) + 1):
        context = stream[:n]
        proposal = incremental.propose("r", context, 1, max_tokens)
        assert proposal == with_history().propose("r", context, 1, max_tokens)
        if not proposal:
            continue
        # some suffix of the context, followed by the whole proposal, occurs in the
        # request's own tokens or in a cached output, within the depth and the factor
        assert len(proposal) <= max_tokens
        assert any(
            len(proposal) <= int(m * config.max_spec_factor + 1e-6)
            and m + len(proposal) <= config.max_tree_depth
            and _occurrences([context, *cached], [*context[-m:], *proposal]) > 0
            for m in range(1, n + 1)
        )


def test_the_two_trees_agree_on_long_repetitive_outputs(tree_implementation: str) -> None:
    # outputs that repeat one another's phrases (the agentic case), many evictions:
    # the C++ tree gives the Python tree's drafts and node count after every operation
    if tree_implementation != "native":
        pytest.skip("compares the C++ tree with the Python one")
    rng = random.Random(5)
    phrases = [[rng.randrange(50_000) for _ in range(rng.randrange(3, 12))] for _ in range(12)]
    outputs = {native: new_suffix_tree(24, native) for native in (False, True)}
    requests = {native: new_suffix_tree(24, native) for native in (False, True)}
    num_drafted = 0
    for seq_id in range(60):
        output = [t for _ in range(rng.randrange(5, 30)) for t in rng.choice(phrases)]
        context = [t for _ in range(3) for t in rng.choice(phrases)]
        for native in (False, True):
            outputs[native].insert(seq_id, output)
            if seq_id >= 16:
                outputs[native].remove(seq_id - 16)
            requests[native].extend(0, context)
        for factor, min_prob in ((1.0, 0.1), (3.0, 0.0)):
            draft = outputs[False].draft_matching(context, 16, factor, min_prob)
            assert outputs[True].draft_matching(context, 16, factor, min_prob) == draft
            num_drafted += len(draft[0]) > 1
            assert requests[True].draft_after(0, 16, factor, min_prob) == (
                requests[False].draft_after(0, 16, factor, min_prob)
            )
        assert outputs[True].num_nodes() == outputs[False].num_nodes()
        assert requests[True].num_nodes() == requests[False].num_nodes()
    assert num_drafted > 60
