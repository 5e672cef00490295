"""Where an architecture's checkpoint stores each tensor the decoder reads.

The decoder (:mod:`pagedllm.models.decoder`) asks for tensors by Llama's Hugging Face names
(``model.layers.0.self_attn.o_proj.weight``; a fused q/k/v tensor as
``self_attn.qkv_proj``, rows q then k then v; GPT-2's position embedding as
``model.embed_positions.weight``). GPT-NeoX, GPT-2 and Falcon name their tensors
otherwise and fuse q/k/v in other row orders (see ``ModelConfig.qkv_layout``); GPT-2
stores its layer matrices transposed (``Conv1D``, ``[in, out]``); StableLM stores its
per-head q/k norms one tensor per head. :func:`checkpoint_source` answers the decoder's
reads from the stored tensors; :func:`stored_shapes` renames a shape table the other way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from pagedllm.models.config import ModelConfig
from pagedllm.models.errors import ModelLoadError

HEAD = "{}"  # in a stored name: one tensor per head, stacked into one [heads, ...]


@dataclass(frozen=True)
class Naming:
    """How one architecture names its tensors, relative to the decoder's names.

    ``whole_model``: decoder name -> stored name of embeddings, final norm, LM head.
    ``layer_prefix``: the stored prefix of layer ``i`` (a format string).
    ``modules``: a layer's decoder module name (``"self_attn.o_proj"``) -> stored name
    (the ``.weight`` / ``.bias`` ending is kept); absent ones are stored as named.
    ``transposed``: 2-D layer matrices are stored ``[in, out]``.
    ``optional_prefix``: a prefix some checkpoints of the architecture leave out (the
    original GPT-2 files name ``h.0.ln_1.weight``, transformers ``transformer.h.0...``).
    """

    whole_model: Mapping[str, str] = field(default_factory=dict)
    layer_prefix: str = "model.layers.{}."
    modules: Mapping[str, str] = field(default_factory=dict)
    transposed: bool = False
    optional_prefix: str = ""


def _final_norm(stored: str) -> dict[str, str]:
    return {f"model.norm.{kind}": f"{stored}.{kind}" for kind in ("weight", "bias")}


def _falcon(config: ModelConfig) -> Naming:
    two_norms = {"input_layernorm": "ln_attn", "post_attention_layernorm": "ln_mlp"}
    return Naming(
        whole_model={
            "model.embed_tokens.weight": "transformer.word_embeddings.weight",
            "lm_head.weight": "lm_head.weight",
            **_final_norm("transformer.ln_f"),
        },
        layer_prefix="transformer.h.{}.",
        modules={
            "self_attn.qkv_proj": "self_attention.query_key_value",
            "self_attn.o_proj": "self_attention.dense",
            "mlp.up_proj": "mlp.dense_h_to_4h",
            "mlp.down_proj": "mlp.dense_4h_to_h",
            **(two_norms if config.norm_layout == "parallel" else {}),
        },
    )


NAMINGS: dict[str, Callable[[ModelConfig], Naming]] = {
    "stablelm": lambda config: Naming(
        modules={
            "self_attn.q_norm": f"self_attn.q_layernorm.norms.{HEAD}",
            "self_attn.k_norm": f"self_attn.k_layernorm.norms.{HEAD}",
        }
    ),
    "gpt_neox": lambda config: Naming(
        whole_model={
            "model.embed_tokens.weight": "gpt_neox.embed_in.weight",
            "lm_head.weight": "embed_out.weight",
            **_final_norm("gpt_neox.final_layer_norm"),
        },
        layer_prefix="gpt_neox.layers.{}.",
        modules={
            "self_attn.qkv_proj": "attention.query_key_value",
            "self_attn.o_proj": "attention.dense",
            "mlp.up_proj": "mlp.dense_h_to_4h",
            "mlp.down_proj": "mlp.dense_4h_to_h",
        },
    ),
    "gpt2": lambda config: Naming(
        whole_model={
            "model.embed_tokens.weight": "transformer.wte.weight",
            "model.embed_positions.weight": "transformer.wpe.weight",
            "lm_head.weight": "lm_head.weight",
            **_final_norm("transformer.ln_f"),
        },
        layer_prefix="transformer.h.{}.",
        modules={
            "input_layernorm": "ln_1",
            "post_attention_layernorm": "ln_2",
            "self_attn.qkv_proj": "attn.c_attn",
            "self_attn.o_proj": "attn.c_proj",
            "mlp.up_proj": "mlp.c_fc",
            "mlp.down_proj": "mlp.c_proj",
        },
        transposed=True,
        optional_prefix="transformer.",
    ),
    "falcon": _falcon,
}


def _naming(config: ModelConfig) -> Naming:
    make = NAMINGS.get(config.architecture)
    return make(config) if make else Naming()


def _split(name: str) -> tuple[int, str, str]:
    """``(layer, module, kind)`` of a decoder name ``model.layers.<layer>.<module>.<kind>``."""
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return int(layer), module, kind


def stored_name(config: ModelConfig, name: str) -> str:
    """The stored name of the decoder's tensor ``name`` (a per-head tensor's name holds
    :data:`HEAD` where the head's index goes)."""
    naming = _naming(config)
    if name in naming.whole_model or not name.startswith("model.layers."):
        return naming.whole_model.get(name, name)
    layer, module, kind = _split(name)
    return f"{naming.layer_prefix.format(layer)}{naming.modules.get(module, module)}.{kind}"


def qkv_rows_stacked(fused: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A stored q/k/v weight ``[rows, in]`` or bias ``[rows]`` in ``config.qkv_layout``'s
    row order, reordered to all q heads, then all k heads, then all v heads."""
    heads, groups, dim = config.num_heads, config.num_kv_heads, config.head_dim
    rest = fused.shape[1:]
    if config.qkv_layout == "per_head":
        return fused.reshape(heads, 3, dim, *rest).transpose(0, 1).reshape(fused.shape)
    if config.qkv_layout == "per_group":
        per_group = fused.reshape(groups, heads // groups + 2, dim, *rest)
        parts = (per_group[:, :-2], per_group[:, -2], per_group[:, -1])
        return torch.cat([part.reshape(-1, *rest) for part in parts])
    return fused


def checkpoint_source(
    config: ModelConfig, get: Callable[[str], torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """The decoder's weight source over ``get``, which reads stored names."""
    naming = _naming(config)
    prefix = naming.optional_prefix

    def fetch(stored: str) -> torch.Tensor:
        try:
            return get(stored)
        except ModelLoadError:
            if not prefix or not stored.startswith(prefix):
                raise
            return get(stored[len(prefix) :])

    def read(name: str) -> torch.Tensor:
        stored = stored_name(config, name)
        if HEAD in stored:
            heads = config.num_heads if ".q_norm." in name else config.num_kv_heads
            return torch.stack([fetch(stored.format(h)) for h in range(heads)])
        tensor = fetch(stored)
        if name.startswith("model.layers."):
            if naming.transposed and tensor.dim() == 2:
                tensor = tensor.T
            if config.qkv_layout and ".qkv_proj." in name:
                tensor = qkv_rows_stacked(tensor, config)
        return tensor

    return read


def stored_shapes(
    config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Decoder name -> shape, as stored name -> stored shape (per-head tensors apart)."""
    naming = _naming(config)
    stored: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        target = stored_name(config, name)
        if HEAD in target:
            stored.update({target.format(h): shape[1:] for h in range(shape[0])})
        elif naming.transposed and name.startswith("model.layers.") and len(shape) == 2:
            stored[target] = shape[::-1]
        else:
            stored[target] = shape
    return stored
