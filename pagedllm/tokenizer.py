"""Text <-> token ids for a loaded model: encode, decode, chat templates, streaming.

A thin layer over a transformers fast tokenizer, so encoding, decoding and chat
templates behave exactly as transformers' do; streaming decode uses the Rust
``tokenizers.decoders.DecodeStream`` so each generated token costs microseconds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
import transformers
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm import user_cache
from pagedllm.structured_output import COMPACT_JSON_BY_DEFAULT, GrammarCompiler

logger = logging.getLogger("pagedllm")

# Token texts that end a turn in common chat formats; one found among a
# tokenizer's special tokens is a stop token even if the checkpoint names
# another EOS (llama.cpp decides end-of-generation the same way).
END_OF_TURN_TEXTS = (
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
)

# Token texts that open a fill-in-the-middle prompt in common formats.
FIM_PREFIX_TEXTS = ("<fim_prefix>", "<|fim_prefix|>", "<|fim_begin|>", "<PRE>", "▁<PRE>")

# Prompt tokens given to a streaming decoder as context (enough for the
# decoder to know whether the first generated token starts a word).
PROMPT_CONTEXT_TOKENS = 8


class IncrementalDecoder:
    """Turns generated token ids into text one token at a time.

    Invariant: the pieces :meth:`add` returns are valid UTF-8 text; a token that ends
    inside a multi-byte character yields ``""`` until the character is complete.
    Special tokens (EOS, chat markers) are skipped.
    """

    def __init__(self, backend: object, prompt_ids: Sequence[int] | None) -> None:
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else None
        self._backend = backend
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text it completes (maybe ``""``)."""
        return self._stream.step(self._backend, token_id) or ""


def converted_folder(path: Path) -> Path:
    """Where the tokenizer converted from the GGUF file ``path`` is cached: named by the
    file's resolved path, size and modification time and the versions of transformers
    and tokenizers, so a changed file or library converts anew."""
    stat = path.stat()
    key = [str(path.resolve()), stat.st_size, stat.st_mtime_ns, transformers.__version__,
           tokenizers.__version__]  # fmt: skip
    digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]
    return user_cache.cache_dir() / "tokenizers" / f"{path.stem}-{digest}"


class Tokenizer:
    """A model's tokenizer plus the token ids that end generation."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int] = ()):
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        special = set(hf_tokenizer.all_special_tokens) | {
            t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special
        }
        end_of_turn = hf_tokenizer.convert_tokens_to_ids(
            [text for text in END_OF_TURN_TEXTS if text in special]
        )
        stop = {*eos_token_ids, *end_of_turn}
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        self.stop_token_ids: set[int] = stop
        self.compact_json = COMPACT_JSON_BY_DEFAULT
        """Whether structured JSON is compact when a request leaves it open (see
        :meth:`with_compact_json`)."""
        self._grammar_compilers: dict[int, GrammarCompiler] = {}

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face checkpoint folder."""
        return cls(AutoTokenizer.from_pretrained(folder), eos_token_ids)

    @classmethod
    def from_gguf(cls, path: Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Build the tokenizer and chat template stored in a GGUF file's metadata.

        transformers' conversion parses the whole file again and takes seconds (3.2 s for
        the default model's 49,152 tokens on a 2-core AMD EPYC), so its result is kept as
        a tokenizer folder (:meth:`save`) in the user's cache, :func:`converted_folder`,
        and read from there (0.1 s) while the file and the tokenizer libraries stay the
        same. A cache that cannot be written or read only costs the conversion."""
        folder = converted_folder(path)
        if (folder / "tokenizer.json").is_file():
            try:
                return cls.from_folder(folder, eos_token_ids)
            except (OSError, ValueError) as err:
                logger.warning("Converting the tokenizer again: %s is unreadable (%s)", folder, err)
                shutil.rmtree(folder, ignore_errors=True)
        tokenizer = cls(
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), eos_token_ids
        )
        tokenizer._keep(folder)
        return tokenizer

    def _keep(self, folder: Path) -> None:
        """:meth:`save` into ``folder`` whole or not at all (written beside it, then
        renamed); a cache that cannot take it is skipped with a log line."""
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder.parent) as pending:
                self.save(Path(pending) / "tokenizer")
                os.rename(Path(pending) / "tokenizer", folder)
        except OSError as err:
            logger.info("The converted tokenizer is not cached in %s: %s", folder, err)

    @property
    def has_fill_in_the_middle(self) -> bool:
        """True when the vocabulary holds a fill-in-the-middle prefix token."""
        vocab = self._hf.get_vocab()
        return any(text in vocab for text in FIM_PREFIX_TEXTS)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text (as the tokenizer spells it) and id, added tokens included."""
        return self._hf.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model wants it."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, object]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation, as transformers renders it.

        ``add_generation_prompt`` appends the header that opens the assistant's turn;
        ``tools`` (OpenAI's JSON) go to templates that render them (:attr:`renders_tools`).
        """
        return self._hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads ``tools`` (and so knows tool turns)."""
        template = self._hf.chat_template
        return isinstance(template, str) and "tools" in template

    def info(self) -> dict[str, object]:
        """The tokenizer's class, special tokens and chat template (None where it has
        none): what a client needs to tokenize like the server (``/tokenizer_info``)."""
        hf = self._hf
        return {
            "tokenizer_class": type(hf).__name__,
            "bos_token": hf.bos_token,
            "eos_token": hf.eos_token,
            "pad_token": hf.pad_token,
            "unk_token": hf.unk_token,
            "add_bos_token": getattr(hf, "add_bos_token", None),
            "chat_template": hf.chat_template,
        }

    def with_compact_json(self, compact_json: bool) -> Tokenizer:
        """This tokenizer with :attr:`compact_json` set: itself when it already is, else
        a copy with its own grammar compilers (an engine's setting must not reach another
        engine sharing the loaded model)."""
        if compact_json == self.compact_json:
            return self
        twin = copy.copy(self)
        twin.compact_json = compact_json
        twin._grammar_compilers = {}
        return twin

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler:
        """The structured-output compiler for a model of ``vocab_size`` logits (made
        once; it caches what it compiles). Its grammars end with ``stop_token_ids``;
        its JSON is compact by default when :attr:`compact_json`."""
        compiler = self._grammar_compilers.get(vocab_size)
        if compiler is None:
            compiler = GrammarCompiler(self._hf, vocab_size, self.stop_token_ids, self.compact_json)
            self._grammar_compilers[vocab_size] = compiler
        return compiler

    def save(self, folder: Path) -> None:
        """Write a Hugging Face tokenizer folder: ``tokenizer.json`` and
        ``tokenizer_config.json`` holding the special tokens and the chat template, as a
        ``PreTrainedTokenizerFast`` (which transformers 4 and 5 both load)."""
        folder = Path(folder)
        self._hf.save_pretrained(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        template = folder / "chat_template.jinja"
        if template.is_file():
            config["chat_template"] = template.read_text(encoding="utf-8")
            template.unlink()
        elif self._hf.chat_template is not None:
            config["chat_template"] = self._hf.chat_template
        for machine_specific in ("is_local", "local_files_only", "name_or_path"):
            config.pop(machine_specific, None)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    def incremental_decoder(self, prompt_ids: Sequence[int] | None = None) -> IncrementalDecoder:
        """A streaming decoder for one sequence; ``prompt_ids`` give it context."""
        return IncrementalDecoder(self._backend, prompt_ids)

