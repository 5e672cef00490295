"""A tokenizer converted from GGUF metadata is cached as a tokenizer folder and read
back the same: encoding, decoding, chat rendering, stop tokens."""

from __future__ import annotations

import os

import pytest
import transformers

from pagedllm import user_cache
from pagedllm.models.default import default_model_path
from pagedllm.tokenizer import Tokenizer, converted_folder

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "é 日本語 🙂", "<|im_start|>user\nhi"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is paged attention?"},
]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path / "pagedllm")
    return tmp_path / "pagedllm"


def forbid_conversion(monkeypatch):
    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):
        assert "gguf_file" not in kwargs, "converted the GGUF again instead of the cache"
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)


def test_second_load_reads_the_cache_and_behaves_the_same(empty_cache, monkeypatch):
    path = default_model_path()
    converted = Tokenizer.from_gguf(path, [2])
    folder = converted_folder(path)
    assert folder.parent == empty_cache / "tokenizers"
    assert (folder / "tokenizer.json").is_file()
    assert not [p for p in folder.parent.iterdir() if p != folder]  # no leftover temp folder

    forbid_conversion(monkeypatch)
    cached = Tokenizer.from_gguf(path, [2])
    assert cached.stop_token_ids == converted.stop_token_ids
    assert cached.info() == converted.info()
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special_tokens=False) == converted.decode(
            ids, skip_special_tokens=False
        )
    assert cached.apply_chat_template(CONVERSATION) == converted.apply_chat_template(
        CONVERSATION
    )


def test_a_changed_file_gets_its_own_folder(tmp_path, empty_cache):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    folders = {converted_folder(model)}
    os.utime(model, ns=(0, 10**9))
    folders.add(converted_folder(model))
    model.write_bytes(b"GGUF and more")
    folders.add(converted_folder(model))
    assert len(folders) == 3


def test_an_unreadable_cache_entry_is_converted_again_and_replaced(
    empty_cache, monkeypatch, caplog
):
    path = default_model_path()
    folder = converted_folder(path)
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="pagedllm"):
        tokenizer = Tokenizer.from_gguf(path)
    assert "unreadable" in caplog.text
    forbid_conversion(monkeypatch)
    assert Tokenizer.from_gguf(path).encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])


def test_an_unwritable_cache_costs_only_the_conversion(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(user_cache, "cache_dir", lambda: blocker / "pagedllm")
    tokenizer = Tokenizer.from_gguf(default_model_path())
    assert tokenizer.encode("Hello, world!")
