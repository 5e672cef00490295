"""A Hugging Face folder's tokenizer files: loaded with the model, stop ids gathered."""

from __future__ import annotations

import json

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pagedllm.models import load_model

WORDS = ["<unk>", "<s>", "</s>", "<|eot_id|>", "hello", "paged", "world"]


def write_folder_with_tokenizer(folder) -> None:
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(WORDS),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            eos_token_id=2,
        )
    ).save_pretrained(folder, safe_serialization=True)
    backend = RustTokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|eot_id|>"],
    )
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))


def test_folder_tokenizer_and_stop_ids(tmp_path):
    write_folder_with_tokenizer(tmp_path)
    tokenizer = load_model(tmp_path).tokenizer
    ids = tokenizer.encode("hello paged world", add_special_tokens=False)
    assert ids == [4, 5, 6]
    assert tokenizer.eos_token_id == 2
    # config.json's EOS, the end-of-turn special token, generation_config.json's list
    assert tokenizer.stop_token_ids == {2, 3, 5}


def test_folder_without_tokenizer_files_has_none(tmp_path):
    write_folder_with_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    assert load_model(tmp_path).tokenizer is None
