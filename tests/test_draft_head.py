"""``draft_vocab_size``: a draft scores its first token ids and each sequence's own
tokens, exactly as its whole LM head scores them, and never guesses anything else; the
target's greedy tokens are unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine_draft_model import draft_config, draft_engine
from test_engine_speculation import run_stepwise, samples
from test_engine_swap import workload
from tiny_checkpoints import tiny_engine

from pagedllm.engine.draft_head import DraftHead, leading_rows
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import TokenSequence
from pagedllm.models.interleaved_weight import InterleavedWeight, interleavable
from pagedllm.models.linear import linear, weight_storage
from pagedllm.models.quantized_weight import QuantizedWeight
from pagedllm.spec_decode.config import SpeculativeConfig


def sequence(seq_id: int, tokens: list[int]) -> TokenSequence:
    return TokenSequence("r", tokens, SamplingParams(), 0.0, seq_id=seq_id)


@pytest.mark.parametrize("model_fixture", ["tiny_model", "default_model"])
def test_scores_are_the_whole_heads_on_the_draft_vocabulary(model_fixture, request):
    """Both a float head (the tiny model's) and GGUF blocks (the default model's)."""
    model = request.getfixturevalue(model_fixture).model
    vocab = model.config.vocab_size
    head = DraftHead(model.lm_head, 100, vocab, model.finish_logits)
    assert head.size == 144  # rounded up to whole panels and groups
    own = [3, 200, 200, 450, vocab - 1]
    head.note(sequence(7, own))
    hidden = torch.randn(2, model.config.hidden_size).to(model.dtype)
    got = head.logits(hidden, [7, 8])
    whole = model.compute_logits(hidden)
    draftable = torch.zeros(vocab, dtype=torch.bool)
    draftable[: head.size] = True
    draftable[[200, 450, vocab - 1]] = True
    torch.testing.assert_close(got[0, draftable], whole[0, draftable], rtol=0.02, atol=0.05)
    assert torch.isinf(got[0, ~draftable]).all()
    assert torch.isinf(got[1, head.size :]).all()  # sequence 8 brought no tokens of its own
    torch.testing.assert_close(got[1, : head.size], whole[1, : head.size], rtol=0.02, atol=0.05)


def test_tokens_noted_later_join_and_a_forgotten_sequence_leaves():
    weight = torch.randn(300, 16)
    head = DraftHead(weight, 48, 300, lambda x: x)
    first = sequence(1, [1, 2, *range(100, 180)])  # more rows than the store starts with
    head.note(first)
    first.append_token(250)
    head.note(first)
    head.note(sequence(2, [260, 120]))  # 120 is stored once, for both
    hidden = torch.randn(2, 16)
    logits = head.logits(hidden, [1, 2])
    expected = weight @ hidden.T
    for row, tokens in ((0, [*range(100, 180), 250]), (1, [260, 120])):
        torch.testing.assert_close(logits[row, tokens], expected[tokens, row])
    assert torch.isinf(logits[1, 250]) and torch.isinf(logits[0, 260])
    head.forget(1)
    assert torch.isinf(head.logits(hidden[:1], [1])[0, 250])


def test_a_head_in_a_layout_that_cannot_be_cut_is_refused():
    class Opaque:
        out_features, in_features = 96, 8

    assert leading_rows(Opaque(), 48) is None
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftHead(Opaque(), 48, 96, lambda x: x)


def test_leading_rows_multiply_as_the_whole_head_does(default_model):
    """GGUF blocks row by row, and interleaved by 16 rows with int8 activations (the
    bfloat16 Q4_0 draft's head), where this CPU runs that kernel."""
    head = default_model.model.lm_head
    assert isinstance(head, QuantizedWeight)
    hidden = torch.randn(3, default_model.config.hidden_size)
    forms = [(head, hidden)]
    if interleavable(head):
        interleaved = replace(InterleavedWeight.interleave(head), int8_activations=True)
        forms.append((interleaved, hidden.to(torch.bfloat16)))
    for weight, x in forms:
        leading = leading_rows(weight, 480)
        assert weight_storage(leading).data_ptr() == weight_storage(weight).data_ptr()
        whole = linear(x, weight, float_output=True)
        assert torch.equal(linear(x, leading, float_output=True), whole[:, :480])


def test_the_config_takes_a_positive_size_for_draft_models_only():
    base = {"method": "draft_model", "model": "default", "num_speculative_tokens": 4}
    assert SpeculativeConfig.parse({**base, "draft_vocab_size": 16384}).draft_vocab_size == 16384
    with pytest.raises(ValueError, match="positive integer"):
        SpeculativeConfig.parse({**base, "draft_vocab_size": 0})
    with pytest.raises(ValueError, match="does not take draft_vocab_size"):
        SpeculativeConfig.parse(
            {"method": "ngram", "num_speculative_tokens": 4, "draft_vocab_size": 10}
        )


def test_greedy_tokens_are_the_targets_with_a_small_draft_vocabulary(tiny_model):
    """The tiny draft scores 96 of its 512 ids plus each sequence's own: some guesses
    are kept, none outside that vocabulary is made, and the tokens are the target's."""
    prompts, params = workload(count=12)
    common = dict(max_model_len=100, max_num_batched_tokens=64)
    expected = run_stepwise(tiny_engine(tiny_model, 256, **common), prompts, params)
    spec = draft_config(tiny_model.source, dtype="bfloat16", draft_vocab_size=96)
    engine = draft_engine(tiny_model, 256, spec, **common)
    guessed: list[tuple[list[int], list[int]]] = []
    propose_all = engine.speculator.proposer.propose_all

    def spy(requests, wanted):
        proposals = propose_all(requests, wanted)
        guessed.extend((seq.all_token_ids[:], guess.token_ids) for seq, guess in proposals)
        return proposals

    engine.speculator.proposer.propose_all = spy
    got = run_stepwise(engine, prompts, params)
    assert samples(got) == samples(expected)
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert guessed
    for history, guesses in guessed:
        allowed = set(range(96)) | set(history)
        assert all(token in allowed for token in guesses)
    assert engine.get_stats().num_blocks_used == 0
