"""Random weights from a model shape alone (``load_format="dummy"``): memory and speed
experiments at a real model's scale without its checkpoint.

Each tensor is drawn on its own, directly on the target device and in the target dtype,
from a generator seeded by ``(seed, tensor name)``: the same seed gives the same weights
whatever order they are read in (on one device type; CPU and CUDA generators differ),
and loading holds no more than the model plus a few tensors of one layer. The scales
keep activations finite and logits spread out in bfloat16 or float16 through dozens of
layers: matrices and embeddings normal with standard deviation ``MATRIX_STD``, biases
``BIAS_STD``, norms multiplying by one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.models.architectures import NORM_NAMES
from pagedllm.models.checkpoint_names import checkpoint_source, stored_shapes
from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.default import default_model_path
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.loader_gguf import gguf_config, open_gguf
from pagedllm.models.loader_safetensors import read_config_file
from pagedllm.models.presets import PRESETS

MATRIX_STD = 0.02
BIAS_STD = 0.02
DEFAULT_SEED = 0


def dummy_config(model: str | Path | None) -> tuple[ModelConfig, Path]:
    """The shape ``model`` names, and what names it: a preset name (case-insensitive, see
    :data:`~pagedllm.models.presets.PRESETS`; returned as a one-part path), a
    ``config.json`` file or a folder holding one, or a ``.gguf`` file (its metadata;
    ``None`` or ``"default"`` is the embedded default model's)."""
    if isinstance(model, str) and model.lower() in PRESETS:
        preset = PRESETS[model.lower()]
        return ModelConfig.from_hf_dict(preset.hf_config), Path(model.lower())
    is_default = model is None or model == "default"
    path = default_model_path() if is_default else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return read_config_file(path / "config.json"), path
    if path.is_file() and path.suffix == ".json":
        return read_config_file(path), path
    if path.is_file() and path.suffix == ".gguf":
        return gguf_config(open_gguf(path), path), path
    raise ModelLoadError(
        f"load_format='dummy' needs a model shape: {str(model)!r} is not a preset "
        f"({', '.join(PRESETS)}), a config.json file, a folder holding one, or a .gguf file"
    )


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, for every parameter of a checkpoint of this shape, as the
    architecture's checkpoints name and store them (``lm_head.weight`` only when the
    embeddings are not tied)."""
    return stored_shapes(config, decoder_shapes(config))


def decoder_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """:func:`parameter_shapes` under the names the decoder reads (see
    :mod:`pagedllm.models.checkpoint_names`)."""
    hidden, q_size, kv_size = config.hidden_size, config.q_size, config.kv_size
    spec = config.spec
    norm_tensors = {"rms": ("weight",), "layer": ("weight", "bias"), "layer_plain": ()}
    kinds = norm_tensors[spec.norm]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    if spec.positions == "learned":
        shapes["model.embed_positions.weight"] = (config.max_position_embeddings, hidden)
    shapes.update({f"model.norm.{kind}": (hidden,) for kind in kinds})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    fused_qkv = spec.fused_projections or config.qkv_layout is not None
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        norms = NORM_NAMES[config.norm_layout]
        shapes.update({f"{prefix}{norm}.{kind}": (hidden,) for norm in norms for kind in kinds})
        if config.qk_norm == "layer_head":
            shapes[attn + "q_norm.weight"] = (config.num_heads, config.head_dim)
            shapes[attn + "k_norm.weight"] = (config.num_kv_heads, config.head_dim)
        elif config.qk_norm:
            per_head = config.qk_norm == "head"
            shapes[attn + "q_norm.weight"] = (config.head_dim if per_head else q_size,)
            shapes[attn + "k_norm.weight"] = (config.head_dim if per_head else kv_size,)
        if fused_qkv:
            shapes[attn + "qkv_proj.weight"] = (q_size + 2 * kv_size, hidden)
        else:
            shapes[attn + "q_proj.weight"] = (q_size, hidden)
            shapes[attn + "k_proj.weight"] = (kv_size, hidden)
            shapes[attn + "v_proj.weight"] = (kv_size, hidden)
        shapes[attn + "o_proj.weight"] = (hidden, q_size)
        if config.sparse_layers and config.sparse_layers[layer]:
            shapes.update(_expert_shapes(config, prefix))
        else:
            width = config.intermediate_size
            if spec.fused_projections:
                shapes[mlp + "gate_up_proj.weight"] = (2 * width, hidden)
            elif spec.gated_mlp:
                shapes[mlp + "gate_proj.weight"] = (width, hidden)
                shapes[mlp + "up_proj.weight"] = (width, hidden)
            else:
                shapes[mlp + "up_proj.weight"] = (width, hidden)
            shapes[mlp + "down_proj.weight"] = (hidden, width)
        if config.attention_bias and config.qkv_layout is not None:
            shapes[attn + "qkv_proj.bias"] = (q_size + 2 * kv_size,)
        elif config.attention_bias:
            shapes[attn + "q_proj.bias"] = (q_size,)
            shapes[attn + "k_proj.bias"] = (kv_size,)
            shapes[attn + "v_proj.bias"] = (kv_size,)
        if config.output_bias:
            shapes[attn + "o_proj.bias"] = (hidden,)
        if config.mlp_bias:
            if spec.gated_mlp:
                shapes[mlp + "gate_proj.bias"] = (config.intermediate_size,)
            shapes[mlp + "up_proj.bias"] = (config.intermediate_size,)
            shapes[mlp + "down_proj.bias"] = (hidden,)
    return shapes


def _expert_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Router, experts and shared expert of one sparse layer, under their checkpoint names."""
    hidden, width = config.hidden_size, config.moe_intermediate_size
    if config.spec.moe == "mixtral":
        block, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    shapes: dict[str, tuple[int, ...]] = {block + "gate.weight": (config.num_experts, hidden)}
    for e in range(config.num_experts):
        expert = f"{block}experts.{e}."
        shapes[f"{expert}{names[0]}.weight"] = (width, hidden)
        shapes[f"{expert}{names[1]}.weight"] = (width, hidden)
        shapes[f"{expert}{names[2]}.weight"] = (hidden, width)
    shared = config.shared_expert_intermediate_size
    if shared:
        shapes[block + "shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[block + "shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[block + "shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[block + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


def dummy_weight_source(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = DEFAULT_SEED,
) -> Callable[[str], torch.Tensor]:
    """A source of the checkpoint's tensors, by their stored names (those of
    :func:`parameter_shapes`), drawing each when it is asked for (on the ``meta`` device:
    shapes only); the decoder reads it through
    :func:`~pagedllm.models.checkpoint_names.checkpoint_source`."""
    if seed < 0:
        raise ModelLoadError(f"the dummy weights' seed must be >= 0, got {seed}")
    shapes = parameter_shapes(config)
    norm_shapes = {n: s for n, s in decoder_shapes(config).items() if n.endswith("norm.weight")}
    norms = set(stored_shapes(config, norm_shapes))
    device = torch.device(device)

    def get(name: str) -> torch.Tensor:
        if name not in shapes:
            raise ModelLoadError(f"no parameter {name!r} in a {config.architecture} model")
        if name in norms:  # a norm multiplying by one
            one = 1.0 - config.spec.norm_offset
            return torch.full(shapes[name], one, dtype=dtype, device=device)
        tensor = torch.empty(shapes[name], dtype=dtype, device=device)
        if device.type == "meta":
            return tensor
        generator = torch.Generator(device=tensor.device)
        generator.manual_seed(_tensor_seed(seed, name))
        std = BIAS_STD if name.endswith(".bias") else MATRIX_STD
        return tensor.normal_(0.0, std, generator=generator)

    return get


def _tensor_seed(seed: int, name: str) -> int:
    """A 32-bit seed for one tensor (the CPU generator keeps only 32 bits of a seed)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def load_dummy_model(
    model: str | Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = DEFAULT_SEED,
    linear_kernel: str = "auto",
    parallel: TensorParallelGroup | None = None,
) -> tuple[ModelConfig, CausalDecoder, Path]:
    """The decoder of the shape ``model`` names (see :func:`dummy_config`) with seeded
    random weights (``parallel``: this rank's slice of them), its config, and its source
    (the preset name or the config's path); ``linear_kernel`` as
    :class:`~pagedllm.models.decoder.CausalDecoder` takes it."""
    config, source = dummy_config(model)
    get = checkpoint_source(config, dummy_weight_source(config, dtype, device, seed))
    decoder = CausalDecoder(config, get, dtype, device, linear_kernel, parallel)
    return config, decoder, source
