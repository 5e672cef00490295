"""min_tokens holds back every id the engine stops on, not only ``eos_token_id``."""

from __future__ import annotations

import dataclasses

from tiny_checkpoints import run_token_ids, tiny_engine

from pagedllm import SamplingParams

PROMPT = [5, 6, 7, 8]


def test_min_tokens_bans_the_whole_stop_set(tiny_model):
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = run_token_ids(tiny_engine(tiny_model, 64), [PROMPT], greedy)["0"][0][0]
    assert first != 1
    # the model's stop set is now {1, first}: its greedy first token is a second stop id
    config = dataclasses.replace(tiny_model.config, eos_token_ids=(1, first))
    engine = tiny_engine(dataclasses.replace(tiny_model, config=config), 64)
    assert engine.stop_token_ids == {1, first}

    unconstrained = SamplingParams(temperature=0.0, max_tokens=8)
    assert run_token_ids(engine, [PROMPT], unconstrained)["0"][0] == [first]

    held = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)
    tokens = run_token_ids(engine, [PROMPT], held)["0"][0]
    assert len(tokens) >= 3
    assert not {1, first} & set(tokens[:3])
