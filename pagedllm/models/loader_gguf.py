"""Load a GGUF file: metadata to :class:`ModelConfig`, tensors to torch.

Matrices the file stores in a block format the CPU kernels run
(:data:`~pagedllm.models.quantized_weight.KERNEL_TYPES`) stay in it by default
(:class:`~pagedllm.models.quantized_weight.QuantizedWeight`); every other tensor is
dequantized to float32 and converted to the model's dtype.

llama.cpp stores a Llama model's Q and K projection rows in an interleaved
order (its RoPE rotates adjacent pairs, Hugging Face's rotates halves); the
rows are put back into the Hugging Face order here, so the decoder sees one
layout whatever the source.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.config import Quantization
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.models.architectures import ARCHITECTURES
from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.gguf_gemma import GEMMA_GGUF_ARCHITECTURES, gemma_fields
from pagedllm.models.gguf_layernorm import (
    LAYERNORM_GGUF_ARCHITECTURES,
    PARTIAL_ROTARY,
    layernorm_fields,
)
from pagedllm.models.quantized_weight import (
    KERNEL_TYPES,
    QuantizedWeight,
    is_quantizable,
    why_kernels_cannot_run,
)
from pagedllm.models.tensor_audit import TrackedSource, refuse_unread
from pagedllm.models.weight_rounding import rounded_source

logger = logging.getLogger("pagedllm")

# GGUF architecture -> (our architecture, whether Q/K rows are interleaved).
GGUF_ARCHITECTURES = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "phi3": ("phi3", False),
    "granite": ("granite", True),
    "qwen2moe": ("qwen2_moe", False),
    "qwen3moe": ("qwen3_moe", False),
    "gemma": ("gemma", False),
    "olmo2": ("olmo2", False),
    "gemma2": ("gemma2", False),
    "gemma3": ("gemma3_text", False),
    **{gguf: (ours, gguf == "olmo") for gguf, ours in LAYERNORM_GGUF_ARCHITECTURES.items()},
}
# Where an architecture's GGUF names differ from LAYER_TENSOR_NAMES (OLMo 2's norms come
# after attention and MLP; Gemma 2/3 have both).
POST_NORM_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
SANDWICH_NORM_NAMES = {**POST_NORM_NAMES, "pre_feedforward_layernorm.weight": "ffn_norm.weight"}
ARCH_LAYER_TENSOR_NAMES = {
    "olmo2": POST_NORM_NAMES,
    "gemma2": SANDWICH_NORM_NAMES,
    "gemma3": SANDWICH_NORM_NAMES,
}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w.
NORMS_STORED_PLUS_ONE = ("gemma", "gemma2", "gemma3")
# GGUF architectures that may hold experts (a llama with experts is Mixtral).
EXPERT_ARCHITECTURES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Granite's multipliers: GGUF metadata key (after "<arch>.") -> ModelConfig field.
GRANITE_SCALES = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_scale",
    "logit_scale": "logits_divisor",
}
# GGUF architectures whose sliding window, when the metadata holds one, covers every layer.
WINDOWED_EVERYWHERE = ("phi3",)

# Per-layer tensor names: Hugging Face suffix -> GGUF suffix.
LAYER_TENSOR_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "input_layernorm.bias": "attn_norm.bias",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.qkv_proj.bias": "attn_qkv.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.bias": "ffn_norm.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate and up rows in one tensor
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
# Per-expert tensors (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj): llama.cpp stacks
# each kind over experts into one [num_experts, rows, cols] tensor per layer.
EXPERT_TENSOR_NAMES = {
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
# GGUF tensors the decoder fuses into one matrix: kept quantized only if they share a type.
FUSED_GGUF_TENSORS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
# Tensor types that are not quantized: expanding them is no loss.
UNQUANTIZED_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)
GLOBAL_TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.norm.bias": "output_norm.bias",
    "model.embed_positions.weight": "position_embd.weight",
    "lm_head.weight": "output.weight",
}


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Parse the file's header, metadata and tensor index; damaged files raise ModelLoadError."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as err:
        raise ModelLoadError(f"damaged or truncated GGUF file {path}: {err}") from err


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF tensor name of a Hugging Face parameter name in a file of GGUF
    architecture ``arch`` (for an expert, the name of the stack holding it: see
    :func:`expert_index`)."""
    if hf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)
    if expert_index(hf_name) is not None:
        kind = suffix.split(".")[3]
        return f"blk.{layer}.{EXPERT_TENSOR_NAMES[kind]}.weight"
    names = {**LAYER_TENSOR_NAMES, **ARCH_LAYER_TENSOR_NAMES.get(arch, {})}
    return f"blk.{layer}.{names[suffix]}"


def expert_index(hf_name: str) -> int | None:
    """The expert a per-expert tensor name refers to, else ``None``."""
    parts = hf_name.split(".")
    is_expert = parts[3:5] in (["block_sparse_moe", "experts"], ["mlp", "experts"])
    return int(parts[5]) if is_expert else None


def metadata_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python scalar, string or list; ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """The decoder shape described by the file's metadata."""
    gguf_arch = metadata_value(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {gguf_arch!r} in {path}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}

    def arch_value(key: str, default: Any = None) -> Any:
        value = metadata_value(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata {gguf_arch}.{key} missing in {path}")
        return value

    num_heads = arch_value("attention.head_count")
    hidden_size = arch_value("embedding_length")
    head_dim = arch_value("attention.key_length", hidden_size // num_heads)
    _refuse_unimplemented_metadata(reader, gguf_arch, head_dim, path)
    num_layers = arch_value("block_count")
    experts = metadata_value(reader, f"{gguf_arch}.expert_count", 0)
    architecture = GGUF_ARCHITECTURES[gguf_arch][0]
    window = metadata_value(reader, f"{gguf_arch}.attention.sliding_window")
    scales: dict[str, Any] = {"sliding_windows": (window,) * num_layers if window else ()}
    if gguf_arch == "granite":  # the converter writes each scale only when set
        scales.update(
            (field, float(metadata_value(reader, f"{gguf_arch}.{key}", 1.0)))
            for key, field in GRANITE_SCALES.items()
        )
        # Without attention.scale, llama.cpp scales scores by head_dim ** -0.5.
        scales["attention_scale"] = metadata_value(reader, f"{gguf_arch}.attention.scale")

    def value(key: str, default: Any) -> Any:
        return metadata_value(reader, f"{gguf_arch}.{key}", default)

    if gguf_arch in GEMMA_GGUF_ARCHITECTURES:
        scales.update(gemma_fields(gguf_arch, value, num_layers, hidden_size, num_heads, head_dim))
    moe = {}
    if experts:  # llama.cpp writes Mixtral as a llama with experts
        architecture = EXPERT_ARCHITECTURES[gguf_arch]
        mixtral = gguf_arch == "llama"
        # Renormalised top-k weights: Mixtral always, Qwen3-MoE by default, Qwen2-MoE not.
        renormalize = metadata_value(
            reader, f"{gguf_arch}.expert_weights_norm", gguf_arch != "qwen2moe"
        )
        moe = dict(
            sparse_layers=(True,) * num_layers,
            num_experts=experts,
            num_experts_per_tok=arch_value("expert_used_count"),
            moe_intermediate_size=arch_value(
                "feed_forward_length" if mixtral else "expert_feed_forward_length"
            ),
            moe_renormalize=mixtral or bool(renormalize),
            shared_expert_intermediate_size=metadata_value(
                reader, f"{gguf_arch}.expert_shared_feed_forward_length", 0
            ),
        )
    vocab = metadata_value(reader, "tokenizer.ggml.tokens")
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    layernorm = gguf_arch in LAYERNORM_GGUF_ARCHITECTURES
    eps_key = "attention.layer_norm_epsilon" if layernorm else "attention.layer_norm_rms_epsilon"
    fields: dict[str, Any] = dict(
        architecture=architecture,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=arch_value("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        intermediate_size=arch_value("feed_forward_length"),
        # llama.cpp fixes the activation per architecture, as transformers' default does
        hidden_act=ARCHITECTURES[architecture].default_activation,
        vocab_size=arch_value("vocab_size", len(vocab) if vocab else None),
        rms_norm_eps=float(arch_value(eps_key)),
        rope_theta=float(arch_value("rope.freq_base", 10000.0)),
        max_position_embeddings=arch_value("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        output_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        rope_scaling=_rope_scaling(reader, gguf_arch, path),
        **scales,
        **moe,
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(
            v for v in (metadata_value(reader, k) for k in eos_keys) if v is not None
        ),
    )
    if layernorm:
        fields.update(layernorm_fields(gguf_arch, value, tensor_names, head_dim))
    return ModelConfig(**fields)


# Metadata keys (after "<arch>.") whose presence changes the math, with the value that
# leaves it unchanged (None: any value is refused).
UNIMPLEMENTED_METADATA = {
    "attention.sliding_window": None,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}


def _refuse_unimplemented_metadata(
    reader: gguf.GGUFReader, arch: str, head_dim: int, path: Path
) -> None:
    for key, neutral in UNIMPLEMENTED_METADATA.items():
        if key == "attention.sliding_window" and arch in WINDOWED_EVERYWHERE:
            continue
        if arch in GEMMA_GGUF_ARCHITECTURES:  # read by gemma_fields
            continue
        value = metadata_value(reader, f"{arch}.{key}")
        if value is not None and value != neutral:
            raise ModelLoadError(
                f"GGUF metadata {arch}.{key}={value!r} is not implemented ({path})"
            )
    rotated = metadata_value(reader, f"{arch}.rope.dimension_count", head_dim)
    values = metadata_value(reader, f"{arch}.attention.value_length", head_dim)
    if rotated != head_dim and arch not in PARTIAL_ROTARY:
        raise ModelLoadError(
            f"GGUF metadata {arch}.rope.dimension_count={rotated} (partial rotary) differs "
            f"from head_dim {head_dim}: not implemented ({path})"
        )
    experts = metadata_value(reader, f"{arch}.expert_count", 0)
    if experts and arch not in EXPERT_ARCHITECTURES:
        raise ModelLoadError(f"GGUF experts of architecture {arch!r} are not implemented ({path})")
    if values != head_dim:
        raise ModelLoadError(
            f"GGUF metadata {arch}.attention.value_length={values} differs from head_dim "
            f"{head_dim}: not implemented ({path})"
        )


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: Path) -> dict[str, Any] | None:
    kind = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    freq_factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freq_factors is not None:
        return {"rope_type": "freq_factors", "factors": dequantized(freq_factors).tolist()}
    if kind == "none":
        return None
    if kind == "linear":
        factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": factor}
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r} in {path}")


def dequantized(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as float32 torch, shaped ``[rows, cols]`` (ggml's shape reversed)."""
    expected = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ModelLoadError(
            f"unsupported tensor type {tensor.tensor_type.name} for tensor {tensor.name!r}"
        ) from err
    if values.size != int(np.prod(expected)):
        raise ModelLoadError(
            f"tensor {tensor.name!r} holds {values.size} values, expected shape {expected}"
        )
    values = np.asarray(values, dtype=np.float32).reshape(expected)
    # Unquantized tensors come back as read-only views of the file: copy those only.
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def deinterleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows ``(i, half)`` back to ``(half, i)``."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def quantized(tensor: Any) -> QuantizedWeight:
    """A GGUF tensor of a :data:`KERNEL_TYPES` type, its blocks copied out of the file."""
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
    kind = gguf.GGMLQuantizationType(tensor.tensor_type)
    return QuantizedWeight(blocks, kind, int(tensor.shape[0]))


def fused_types(stored: str, tensors: dict[str, Any]) -> set[Any]:
    """The types of the GGUF tensors the decoder fuses with ``stored`` (itself included)."""
    parts = stored.split(".")
    group = next((g for g in FUSED_GGUF_TENSORS if len(parts) == 4 and parts[2] in g), None)
    if group is None:
        return {tensors[stored].tensor_type}
    names = (f"{parts[0]}.{parts[1]}.{kind}.{parts[3]}" for kind in group)
    return {tensors[n].tensor_type for n in names if n in tensors}


def keeps_quantization(
    quantization: str, dtype: torch.dtype, device: torch.device, path: Path
) -> bool:
    """Whether quantized matrices stay in block formats (their own, or rounded again with
    ``int8``/``q4_0``): on the CPU with the C++ kernels built and a float32 or bfloat16
    model; otherwise ``auto`` logs why they are expanded and a rounding is refused."""
    if quantization == Quantization.NONE:
        return False
    reason = why_kernels_cannot_run(dtype, device)
    if reason is not None and Quantization(quantization).rounds:
        raise ModelLoadError(f"quantization={quantization!r} is not available: {reason}")
    if reason is not None:
        logger.info("Expanding the quantized weights of %s to %s: %s", path.name, dtype, reason)
    return reason is None


def load_gguf_model(
    path: Path,
    dtype: torch.dtype,
    reader: gguf.GGUFReader | None = None,
    device: torch.device | str = "cpu",
    quantization: str = "auto",
    linear_kernel: str = "auto",
    parallel: TensorParallelGroup | None = None,
    expansion_budget: int = 0,
) -> tuple[ModelConfig, CausalDecoder]:
    """Build the decoder (``parallel``: this rank's slice of it) from a GGUF file.
    With ``quantization="auto"`` on the CPU, each
    matrix stored in a :data:`KERNEL_TYPES` format stays in it (``"int8"`` and ``"q4_0"``
    round every such matrix again, :mod:`~pagedllm.models.weight_rounding`); every
    other tensor (all of them with ``"none"``) is dequantized (one float32 tensor at a
    time, on the CPU) and converted to ``dtype`` on ``device``; ``linear_kernel`` as
    :class:`~pagedllm.models.decoder.CausalDecoder` takes it, and ``expansion_budget``
    (bytes of expanded copies beside kept blocks)."""
    reader = reader or open_gguf(path)
    keep = keeps_quantization(quantization, dtype, torch.device(device), path)
    expanded: set[str] = set()  # quantized types dequantized although they could stay
    config = gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    gguf_arch = metadata_value(reader, "general.architecture")
    interleaved = GGUF_ARCHITECTURES[gguf_arch][1]
    heads_of = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    stacks: dict[str, torch.Tensor] = {}  # one layer's expert stacks, dequantized once

    def get(name: str) -> torch.Tensor:
        stored = gguf_name(name, gguf_arch)
        if stored not in tensors:
            raise ModelLoadError(f"missing tensor {stored!r} (for {name}) in {path}")
        expert = expert_index(name)
        if expert is not None:
            if stored not in stacks:
                layer = stored.split(".")[1]
                for old in [n for n in stacks if n.split(".")[1] != layer]:
                    del stacks[old]
                stacks[stored] = dequantized(tensors[stored])
            return stacks[stored][expert]
        tensor = tensors[stored]
        quantizable = keep and is_quantizable(name)
        if quantizable and tensor.tensor_type in KERNEL_TYPES:
            if len(fused_types(stored, tensors)) == 1:
                weight = quantized(tensor)
                projection = name.split(".")[-2]
                if interleaved and projection in heads_of:
                    rows = torch.arange(weight.out_features)
                    weight = weight.reorder_rows(deinterleave_rope_rows(rows, heads_of[projection]))
                return weight
            expanded.add(f"{tensor.tensor_type.name} (fused with another type)")
        elif quantizable and tensor.tensor_type not in UNQUANTIZED_TYPES:
            expanded.add(tensor.tensor_type.name)
        weight = dequantized(tensor)
        if gguf_arch in NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            weight -= 1
        projection = name.split(".")[-2]
        if interleaved and projection in heads_of:
            weight = deinterleave_rope_rows(weight, heads_of[projection])
        return weight

    tracked = TrackedSource(get)
    rounding = Quantization(quantization)
    weights = rounded_source(tracked, rounding) if keep and rounding.rounds else tracked
    decoder = CausalDecoder(
        config, weights, dtype, device, linear_kernel, parallel, expansion_budget
    )
    if expanded:
        logger.info(
            "Dequantized to %s at load (no kernels keep them quantized): %s tensors",
            dtype,
            ", ".join(sorted(expanded)),
        )
    # rope_freqs.weight was read into the config's rope scaling.
    refuse_unread(
        tensors,
        {gguf_name(n, gguf_arch) for n in tracked.read},
        {"rope_freqs.weight"},
        f"the GGUF {path}",
    )
    return config, decoder
