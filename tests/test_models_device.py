"""The decoder on a device: every tensor it reads lives there, and the torch-operator path
(the one CUDA takes: no AVX-512 kernels, plain ``[out, in]`` weights) gives transformers'
logits and greedy tokens.

Without a GPU the path runs on the CPU with the kernels turned off, and on the ``meta``
device (shapes only), where a tensor left on or made on the CPU shows as a device
mismatch. The CUDA tests skip without CUDA.

Tolerances: float32 logits within 1e-4 of transformers' on the CPU (see
test_models_logits.py); on CUDA within 1e-3, as cuBLAS sums in other orders than the
CPU's BLAS (a wrong weight or rotation moves logits by 1e-2 or more).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models_logits import TINY_SHAPE, write_checkpoint

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.dense_backend import dense_metadata
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import same_device
from pagedllm.models import fused, linear, load_model, rope
from pagedllm.models.rope import RotaryTable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 12


class CausalSdpaBackend:
    """Whole-sequence causal attention with torch's SDPA, on the tensors' device; the
    engine's paged backends are tested elsewhere."""

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        bounds = metadata.query_start_loc.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            heads_first = [
                x[start:end].repeat_interleave(n, dim=1).transpose(0, 1)
                for x, n in ((q, 1), (k, group), (v, group))
            ]
            attended = F.scaled_dot_product_attention(
                *heads_first, is_causal=True, scale=options.scale
            )
            out[start:end] = attended.transpose(0, 1)
        return out


@pytest.fixture
def torch_operators(monkeypatch) -> None:
    """Turn the AVX-512 kernels and oneDNN's layout off, as on CUDA: weights stay plain,
    torch's operators run."""
    for module in (fused, linear, rope):
        monkeypatch.setattr(module, "fits_avx512_kernels", lambda *tensors: False)
    monkeypatch.setattr(linear, "reorderable", lambda weight: False)


def device_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one sequence, inputs on the model's device."""
    ids = torch.tensor(tokens, device=model.device)
    positions = torch.arange(len(tokens), device=model.device)
    hidden = model.forward(ids, positions, CausalSdpaBackend(), dense_metadata([len(tokens)]))
    return model.compute_logits(hidden)


def greedy_tokens(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(device_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def transformers_greedy(reference, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def assert_on(model, device: torch.device) -> None:
    """Every weight, norm, bias and rotary table of ``model`` is a plain tensor on ``device``."""
    tensors = [*model.weights(), model.rotary.cos, model.rotary.sin]
    assert all(t.device == device for t in tensors)
    assert isinstance(model.layers[0].qkv_weight, torch.Tensor)
    assert model.layers[0].qkv_weight.shape == (128, TINY_SHAPE["hidden_size"])


PROMPT = [3, 200, 17, 54, 99, 4, 250, 8, 31]


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied", "llama3-rope-scaling"])
def test_torch_operator_path_on_the_cpu_matches_transformers(tmp_path, name, torch_operators):
    reference = write_checkpoint(tmp_path, name)
    model = load_model(tmp_path, torch.float32, device=torch.device("cpu")).model
    assert_on(model, torch.device("cpu"))
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(device_logits(model, PROMPT), expected, atol=1e-4, rtol=0)
    assert greedy_tokens(model, PROMPT, STEPS) == transformers_greedy(reference, PROMPT, STEPS)


def test_meta_device_holds_every_tensor_and_runs_the_forward_pass(tmp_path, torch_operators):
    write_checkpoint(tmp_path, "qwen2-bias-tied")
    model = load_model(tmp_path, torch.bfloat16, device="meta").model
    meta = torch.device("meta")
    assert_on(model, meta)
    assert all(t.dtype == torch.bfloat16 for t in model.weights())
    logits = device_logits(model, PROMPT)
    assert logits.device == meta
    assert logits.shape == (len(PROMPT), TINY_SHAPE["vocab_size"])


def test_rotary_lookup_stays_on_the_tables_device():
    config = load_model("llama-3-8b", torch.bfloat16, device="meta", load_format="dummy").config
    table = RotaryTable(config, torch.bfloat16, "meta")
    cos, sin = table.lookup(torch.tensor([0, 5, 9]))
    assert cos.device.type == sin.device.type == "meta"
    assert cos.shape == (3, 1, config.head_dim // 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied", "llama3-rope-scaling"])
def test_cuda_float32_matches_transformers(tmp_path, name):
    reference = write_checkpoint(tmp_path, name)
    model = load_model(tmp_path, torch.float32, device="cuda").model
    assert_on(model, torch.device("cuda", torch.cuda.current_device()))
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    ours = device_logits(model, PROMPT).cpu()
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    assert greedy_tokens(model, PROMPT, STEPS) == transformers_greedy(reference, PROMPT, STEPS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_logits_are_close(tmp_path, dtype):
    reference = write_checkpoint(tmp_path, "llama-gqa-untied")
    with torch.no_grad():
        full = reference(torch.tensor([PROMPT])).logits[0]
    model = load_model(tmp_path, dtype, device="cuda").model
    assert all(t.dtype == dtype for t in model.weights())
    half = device_logits(model, PROMPT).cpu()
    assert half.dtype == torch.float32
    # 8 (bfloat16) or 11 (float16) significant bits: only a loose bound holds
    assert (half - full).abs().max() < 0.1 * full.abs().max()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("preset", "dtype"), [("llama-3-8b", torch.bfloat16), ("llama-2-13b", torch.float16)]
)
def test_cuda_dummy_preset_loads_in_place_with_finite_logits(preset, dtype):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_model(preset, dtype, device="cuda", load_format="dummy").model
    weight_bytes = sum(t.numel() * t.element_size() for t in model.weights())
    # the model, plus a few of one layer's tensors while q/k/v and gate/up are joined
    assert torch.cuda.max_memory_allocated() - before < weight_bytes + 2 * 2**30
    assert all(t.device.type == "cuda" for t in model.weights())
    tokens = list(range(100, 164))
    logits = device_logits(model, tokens)
    assert torch.isfinite(logits).all()
    spread = logits.std(dim=-1)
    assert spread.min() > 0.1 and spread.max() < 10.0
    del model, logits
    torch.cuda.empty_cache()


def test_same_device_reads_an_unindexed_cuda_device_as_the_current_one():
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))
    assert same_device(torch.device("cuda:1"), torch.device("cuda:1"))
    if torch.cuda.is_available():
        current = torch.cuda.current_device()
        assert same_device(torch.device("cuda"), torch.device(f"cuda:{current}"))
        assert not same_device(torch.device("cuda"), torch.device(f"cuda:{current + 1}"))
