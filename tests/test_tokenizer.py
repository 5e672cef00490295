"""The default model's tokenizer: round trips, streaming decode, chat template, stop ids."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "Emoji 😀👍🏽 and a family 👨‍👩‍👧 in one line.",
    "中文混合 English 和日本語のテキスト。",
    "  leading spaces,\ttabs\n\nand blank lines  ",
]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.add(token) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_streaming_holds_back_a_split_character(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this emoji's four bytes
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.add(token) for token in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"


def test_streaming_after_a_prompt_emits_only_new_text(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    answer = tokenizer.encode(" Bonjour 👋, ça va?", add_special_tokens=False)
    decoder = tokenizer.incremental_decoder(prompt)
    text = "".join(decoder.add(token) for token in answer + [tokenizer.eos_token_id])
    assert text == " Bonjour 👋, ça va?"  # the EOS token adds no text


def test_chat_template_matches_transformers(tokenizer, default_model):
    from transformers import AutoTokenizer

    path = default_model.source
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another?"},
    ]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert tokenizer.decode(ours, skip_special_tokens=False) == expected
    assert expected.endswith("Another?<|im_end|>\n")


def test_stop_ids_include_end_of_turn(tokenizer):
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [tokenizer.eos_token_id]
    assert tokenizer.eos_token_id in tokenizer.stop_token_ids


def test_decode_skips_special_tokens_by_default(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>" not in tokenizer.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system")
