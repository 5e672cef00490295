"""The facts the planner needs about a model, from a preset, a GGUF file or a config.json.

Sources are read with the loaders' own config readers (GGUF: metadata and tensor index
only, no tensor data), so the planner sees the shape the engine would load.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pagedllm.models.config import ModelConfig
from pagedllm.models.default import default_model_path
from pagedllm.models.dummy import parameter_shapes
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.loader_gguf import gguf_config, open_gguf
from pagedllm.models.loader_safetensors import read_hf_config
from pagedllm.models.partition import TensorPartition
from pagedllm.models.presets import PRESETS


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's memory: its decoder shape and parameter count.

    ``max_context`` is in tokens (the model's ``max_position_embeddings``).
    """

    name: str
    config: ModelConfig
    num_parameters: int

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def gqa_ratio(self) -> float:
        """``num_kv_heads / num_heads``: 1.0 without grouped-query attention."""
        return self.config.num_kv_heads / self.config.num_heads


def shard_config(partition: TensorPartition, rank: int) -> ModelConfig:
    """The shape of what rank ``rank`` stores: its layers
    (:meth:`~pagedllm.models.partition.TensorPartition.local_config`) with its
    vocabulary shard as the vocabulary (its rows of the embedding and of the LM head)."""
    vocab_rows = len(partition.rank_slice(rank).vocab)
    return dataclasses.replace(partition.local_config(rank), vocab_size=vocab_rows)


def rank_parameters(config: ModelConfig, tensor_parallel_size: int = 1) -> tuple[int, ...]:
    """Parameters each of ``tensor_parallel_size`` ranks holds, rank by rank: the tensors
    of :func:`~pagedllm.models.dummy.parameter_shapes` for its :func:`shard_config`.

    A rank holds the q/k/v rows and o columns of its heads (q/k/v biases and per-head
    norms with them), the gate/up rows and down columns of its MLP range (gate/up biases
    with them), its vocabulary shard of the embedding and of the LM head (one shard when
    tied), and every other norm and bias (o and down biases included) whole. Raises
    :class:`~pagedllm.models.partition.PartitionError` for a model the partition
    cannot split.
    """
    partition = TensorPartition(config, tensor_parallel_size)
    return tuple(
        sum(math.prod(shape) for shape in parameter_shapes(shard_config(partition, rank)).values())
        for rank in range(tensor_parallel_size)
    )


def count_parameters(config: ModelConfig) -> int:
    """Parameters of the decoder: every tensor its checkpoint holds (see
    :func:`~pagedllm.models.dummy.parameter_shapes`: embeddings, attention and its
    biases and norms, the MLP or every expert of a mixture, norms, and the output head
    unless tied): :func:`rank_parameters` on one rank."""
    (total,) = rank_parameters(config)
    return total


def resolve_model(model: str | None) -> ModelShape:
    """``model``: ``None``/``"default"`` (the embedded default), a preset name
    (see :data:`~pagedllm.models.presets.PRESETS`), a ``.gguf`` file, a ``config.json``
    file or a folder holding one."""
    if model is not None and model.lower() in PRESETS:
        preset = PRESETS[model.lower()]
        config = ModelConfig.from_hf_dict(preset.hf_config)
        return ModelShape(preset.title, config, preset.num_parameters)
    path = default_model_path() if model in (None, "default") else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        config = gguf_config(open_gguf(path), path)
    elif path.is_dir():
        config = read_hf_config(path)
    elif path.is_file() and path.suffix == ".json":
        config = _read_config_file(path)
    else:
        raise ModelLoadError(
            f"{model!r} is not a preset ({', '.join(PRESETS)}), a .gguf file, "
            "a config.json file or a folder holding one"
        )
    return ModelShape(path.name, config, count_parameters(config))


def _read_config_file(path: Path) -> ModelConfig:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err
    return ModelConfig.from_hf_dict(raw)
