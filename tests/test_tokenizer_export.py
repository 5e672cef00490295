"""``pagedllm export-tokenizer DIR``: the default model's tokenizer as a Hugging Face
folder that transformers loads, encoding and rendering chats exactly as the engine."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from pagedllm.cli import main
from pagedllm.models.default import default_model_path
from pagedllm.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "é 日本語 🙂", "<|im_start|>user\nhi"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is paged attention?"},
    {"role": "assistant", "content": "A KV cache in blocks."},
    {"role": "user", "content": "Thanks!"},
]


def test_exported_folder_loads_and_matches_the_engine(tmp_path):
    folder = tmp_path / "tokenizer"
    assert main(["export-tokenizer", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] and config["eos_token"] == "<|im_end|>"

    exported = AutoTokenizer.from_pretrained(folder)
    engine = Tokenizer.from_gguf(default_model_path())
    for text in TEXTS:
        assert exported.encode(text) == engine.encode(text)
    for messages in (CONVERSATION[:2], CONVERSATION):
        rendered = exported.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(rendered) == engine.apply_chat_template(messages)
    assert exported.eos_token_id in engine.stop_token_ids
