"""The facts the planner needs about a model, from a preset, a GGUF file or a config.json.

Sources are read with the loaders' own config readers (GGUF: metadata and tensor index
only, no tensor data), so the planner sees the shape the engine would load.
"""

from __future__ import annotations

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
from pagedllm.plan.presets import PRESETS


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


def count_parameters(config: ModelConfig) -> int:
    """Parameters of the decoder: every tensor its checkpoint holds (see
    :func:`~pagedllm.models.dummy.parameter_shapes`: embeddings, attention and its
    biases and norms, the MLP or every expert of a mixture, norms, and the output head
    unless tied)."""
    return sum(math.prod(shape) for shape in parameter_shapes(config).values())


def resolve_model(model: str | None) -> ModelShape:
    """``model``: ``None``/``"default"`` (the embedded default), a preset name
    (see :data:`~pagedllm.plan.presets.PRESETS`), a ``.gguf`` file, a ``config.json``
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
