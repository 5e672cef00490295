"""Shared test set-up: never reach a model hub; session-wide models loaded once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU tensors; read when they are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M-Instruct, float32 activations, its
    quantized matrices kept quantized), loaded once per session."""
    from shared_models import default_model as load_once

    return load_once()


@pytest.fixture(scope="session")
def expanded_default_model():
    """The default model with every weight expanded to float32 (quantization="none")."""
    from shared_models import default_model as load_once

    return load_once(quantization="none")


@pytest.fixture(scope="session")
def transformers_default_model():
    """transformers' float32 eager model from the same GGUF, loaded once per session."""
    from shared_models import transformers_default_model as load_once

    return load_once()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama (see tiny_checkpoints.py), loaded once per session."""
    from tiny_checkpoints import write_tiny_llama

    from pagedllm.models.loader import load_model

    return load_model(str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))))
