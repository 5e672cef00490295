"""The decoder of every supported architecture (see ``architectures``), its loaders and the
embedded default model."""

from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.loader import LoadedModel, load_model

__all__ = ["CausalDecoder", "LoadedModel", "ModelConfig", "ModelLoadError", "load_model"]
