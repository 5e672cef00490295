"""Shared test set-up: never reach a model hub; session-wide models loaded once."""

from __future__ import annotations

import faulthandler
import os
from typing import TextIO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU tensors; read when they are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

COLLECTION_WATCHDOG_S = 600
"""Collection (which builds the C++ kernels) taking longer prints every thread's stack
once, so a hang says where it is (each test has pytest's faulthandler_timeout)."""

TERMINAL_STDERR = pytest.StashKey[TextIO]()


def pytest_configure(config):
    # output capture is suspended here, so descriptor 2 is still the terminal's
    config.stash[TERMINAL_STDERR] = os.fdopen(os.dup(2), "w")  # noqa: SIM115


def pytest_unconfigure(config):
    config.stash[TERMINAL_STDERR].close()


def pytest_collection(session):
    stderr = session.config.stash[TERMINAL_STDERR]
    faulthandler.dump_traceback_later(COLLECTION_WATCHDOG_S, file=stderr)


def pytest_collection_finish(session):
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def kernel_choice_without_timing(tmp_path_factory):
    """``linear_kernel="auto"`` picks packed wherever the AVX-512 kernels take a weight,
    and ``attention_kernel="auto"`` the paged kernel for every row, with no timing (nor
    contention check), so every test sees the same kernels whatever the load on the
    machine (batch invariance needs packed and paged); timings and converted tokenizers
    live in a session folder, never the user's cache. GGUF block weights get no expanded
    copy (the blocks measure faster at every row count). test_kernel_choice.py,
    test_sdpa_prefill.py and test_block_expansion.py restore the real timers."""
    from pagedllm import user_cache
    from pagedllm.attention import attention_choice
    from pagedllm.cpu import kernel_choice
    from pagedllm.models import block_expansion

    def packed_first(weight, kernels):
        return {k: dict.fromkeys(kernel_choice.BUCKETS, i + 1.0) for i, k in enumerate(kernels)}

    def paged_first(layout):
        buckets = attention_choice.ROW_BUCKETS
        return {"paged": dict.fromkeys(buckets, 1.0), "sdpa": dict.fromkeys(buckets, 2.0)}

    def blocks_first(*args):
        buckets = block_expansion.ROW_BUCKETS
        return {"blocks": dict.fromkeys(buckets, 1.0), "expanded": dict.fromkeys(buckets, 2.0)}

    folder = tmp_path_factory.mktemp("pagedllm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_choice, "time_kernels", packed_first)
        patch.setattr(block_expansion, "time_forms", blocks_first)
        patch.setattr(attention_choice, "time_prefill", paged_first)
        patch.setattr(user_cache, "cache_dir", lambda: folder)
        # Server processes the tests start keep theirs (timings, tokenizers, recorded
        # request lengths) in a session folder too, never the user's.
        patch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.mktemp("server-cache")))
        patch.setattr(kernel_choice, "contended", lambda cores: False)
        yield


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
    from pagedllm.bench.tiny_llama import write_tiny_llama
    from pagedllm.models.loader import load_model

    return load_model(str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))))


# A server test module defines ``server`` (a ServerProcess, module scope); these reach it.


@pytest.fixture(scope="module")
def http(server):
    """An httpx client of the module's server."""
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    """The openai SDK's client of the module's server (no retries)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(model_folder):
    """The served model's name: its folder's (the module defines ``model_folder``)."""
    return model_folder.name
