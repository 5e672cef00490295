"""``pagedllm export-tokenizer DIR``: the default model's tokenizer as a Hugging Face
folder that transformers loads, encoding and rendering chats exactly as the engine, with
a ``config.json`` describing the model that ``AutoConfig`` loads (offline)."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoTokenizer

from pagedllm.cli import main
from pagedllm.models.config import ModelConfig
from pagedllm.models.default import default_model_path
from pagedllm.models.loader_gguf import gguf_config, open_gguf
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
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "tokenizer.json", "tokenizer_config.json"]
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


def test_exported_config_describes_the_model(tmp_path):
    assert main(["export-tokenizer", str(tmp_path)]) == 0
    path = default_model_path()
    model = gguf_config(open_gguf(path), path)
    loaded = AutoConfig.from_pretrained(tmp_path)  # HF_HUB_OFFLINE=1 (conftest)
    assert loaded.model_type == "llama" and loaded.architectures == ["LlamaForCausalLM"]
    assert loaded.vocab_size == model.vocab_size == 49152
    assert loaded.max_position_embeddings == model.max_position_embeddings
    assert (loaded.num_hidden_layers, loaded.hidden_size) == (model.num_layers, model.hidden_size)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (model.bos_token_id, 2)
    written = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf_dict(written) == model
