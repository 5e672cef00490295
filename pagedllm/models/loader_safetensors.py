"""Load a Hugging Face checkpoint folder: ``config.json`` plus one or sharded safetensors."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import Quantization
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.models.checkpoint_names import checkpoint_source, stored_name
from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.quantized_weight import why_kernels_cannot_run
from pagedllm.models.tensor_audit import TrackedSource, refuse_unread
from pagedllm.models.weight_rounding import rounded_source

SHARD_INDEX = "model.safetensors.index.json"


def read_hf_config(folder: Path) -> ModelConfig:
    """The folder's ``config.json`` as a :class:`ModelConfig`."""
    return read_config_file(folder / "config.json")


def read_config_file(path: Path) -> ModelConfig:
    """A Hugging Face ``config.json`` file (any name) as a :class:`ModelConfig`."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err
    return ModelConfig.from_hf_dict(raw)


def generation_eos_ids(folder: Path) -> tuple[int, ...]:
    """EOS ids listed in ``generation_config.json`` (instruct models list end-of-turn
    tokens there), or ``()`` when the file is absent."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, else every file."""
    index = folder / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    return files


def load_safetensors_model(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: str = "auto",
    linear_kernel: str = "auto",
    parallel: TensorParallelGroup | None = None,
) -> tuple[ModelConfig, CausalDecoder]:
    """Build the decoder (``parallel``: this rank's slice of it) from the folder's
    weights, converted to ``dtype`` on ``device``;
    with ``quantization="int8"`` or ``"q4_0"``, the projections, embedding and LM head
    (those whose rows are a multiple of 32 weights) are rounded at load instead
    (:mod:`~pagedllm.models.weight_rounding`, CPU only);
    ``linear_kernel`` as :class:`~pagedllm.models.decoder.CausalDecoder` takes it.

    The files are memory-mapped and each tensor is moved and converted as the decoder
    reads it, so the host never holds a converted copy of the whole model."""
    config = read_hf_config(folder)
    quantization = Quantization(quantization)
    rounds = quantization.rounds
    reason = why_kernels_cannot_run(dtype, torch.device(device)) if rounds else None
    if reason is not None:
        raise ModelLoadError(f"quantization={quantization.value!r} is not available: {reason}")
    with ExitStack() as stack:
        handle_of_tensor = {}
        for path in shard_files(folder):
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except (OSError, SafetensorError) as err:
                raise ModelLoadError(f"cannot open {path}: {err}") from err
            handle_of_tensor.update(dict.fromkeys(handle.keys(), handle))

        def get(name: str) -> torch.Tensor:
            if name not in handle_of_tensor:
                raise ModelLoadError(f"missing tensor {name!r} in the safetensors of {folder}")
            return handle_of_tensor[name].get_tensor(name)

        tracked = TrackedSource(get)
        source = checkpoint_source(config, tracked)
        weights = rounded_source(source, quantization) if rounds else source
        decoder = CausalDecoder(config, weights, dtype, device, linear_kernel, parallel)
        # A tied checkpoint may still store its LM head; transformers ignores it too. Old
        # GPT-2 and GPT-NeoX files hold their causal masks (spec.unused_suffixes).
        head = stored_name(config, "lm_head.weight")
        known_unused = {head} if config.tie_word_embeddings else set()
        known_unused |= {n for n in handle_of_tensor if n.endswith(config.spec.unused_suffixes)}
        refuse_unread(handle_of_tensor, tracked.read, known_unused, f"the checkpoint {folder}")
        return config, decoder
