"""A tiny random Llama with a byte-level tokenizer and a chat template, written by the
tests themselves: enough for a real server to take text prompts and chat messages in
any language (every byte is a token) in milliseconds per step."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_chat_llama(
    folder: Path,
    seed: int = 0,
    chat_template: str = CHAT_TEMPLATE,
    max_position_embeddings: int = 1024,
) -> Path:
    """Save the checkpoint into ``folder``: 256 byte tokens then the 3 special tokens
    (``<|im_end|>`` ends a turn, ``<|endoftext|>`` is EOS); 2 layers, 2 heads of 64."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    byte_symbols = sorted(ByteLevel.alphabet(), key=lambda symbol: ord(symbol))
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[:2],
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder
