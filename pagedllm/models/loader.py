"""``load_model``: one entry point from a model name or path to a ready decoder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.choice import parse_choice
from pagedllm.config import ActivationQuantization, EngineConfig, LoadFormat, Quantization
from pagedllm.cpu.allocator import release_free_memory
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.models.activation_quantization import quantize_activations
from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.default import default_model_path
from pagedllm.models.dummy import load_dummy_model
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.loader_gguf import load_gguf_model, open_gguf
from pagedllm.models.loader_safetensors import generation_eos_ids, load_safetensors_model
from pagedllm.models.weight_arena import move_into_arena
from pagedllm.tokenizer import Tokenizer

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class LoadedModel:
    """A decoder with its config and tokenizer (``None`` if the checkpoint holds none).

    ``source``: the file or folder loaded; for dummy weights the config's path or the
    preset's name (a one-part path such as ``Path("llama-3-8b")``)."""

    model: CausalDecoder
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: Path


def load_model_for(
    config: EngineConfig, parallel: TensorParallelGroup | None = None
) -> LoadedModel:
    """:func:`load_model` with the engine config's model, dtype, device, format and
    kernel knobs (``parallel``: this rank's group, for its slice)."""
    return load_model(
        config.model,
        config.dtype,
        device=config.device,
        load_format=config.load_format,
        quantization=config.quantization,
        linear_kernel=config.linear_kernel,
        parallel=parallel,
        activation_quantization=config.activation_quantization,
        weight_expansion_memory=0
        if config.speculative_config is not None
        else config.weight_expansion_memory,
    )


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    quantization: str = "auto",
    linear_kernel: str = "auto",
    parallel: TensorParallelGroup | None = None,
    activation_quantization: str = "none",
    weight_expansion_memory: int = 0,
) -> LoadedModel:
    """Load ``model`` onto ``device``; nothing is downloaded.

    ``load_format="auto"``: ``model`` is ``None`` or ``"default"`` (SmolLM2-135M-Instruct),
    a ``.gguf`` file, or a Hugging Face folder (``config.json`` + safetensors).
    ``load_format="dummy"``: seeded random weights of the shape ``model`` names (a preset
    name, a ``config.json`` or a folder holding one, a ``.gguf`` file), with no tokenizer
    (prompts are token ids); see :mod:`pagedllm.models.dummy`.
    ``dtype``: float32, bfloat16 or float16 (on the CPU, float16 runs torch's operators
    and the attention kernel widens it to float32; the AVX-512 kernels take the others).
    ``quantization``: ``"auto"`` keeps a GGUF file's quantized matrices in their block
    formats on the CPU (see :mod:`pagedllm.models.loader_gguf`), ``"none"`` expands them
    to ``dtype``; ``"int8"`` and ``"q4_0"`` round a checkpoint's matrices at load to int8
    per output channel or to Q4_0 blocks (CPU only).
    ``linear_kernel``: the form of the float matrices on the CPU, ``"auto"`` (packed for
    ``packed_linear``, oneDNN's blocked layout or the plain matrix for torch's GEMM, each
    shape by measurement, see :mod:`pagedllm.cpu.kernel_choice`), ``"packed"``,
    ``"onednn"`` or ``"dense"``.
    ``parallel``: load only this tensor-parallel rank's slice of the weights (see
    :mod:`pagedllm.models.sharded_weights`).
    ``activation_quantization``: ``"int8"`` rounds the activations meeting Q8_0 / Q4_0 /
    Q4_1 weights to int8 (see :mod:`pagedllm.models.activation_quantization`); ``"none"``
    multiplies them exactly.
    ``weight_expansion_memory``: bytes that expanded copies of a GGUF file's block weights
    may take where they multiply calls of many rows faster (see
    :mod:`pagedllm.models.block_expansion`); only with ``quantization="auto"`` and
    ``activation_quantization="none"``.
    """
    device = torch.device(device)
    _check_dtype(dtype)
    try:
        activation_quantization = parse_choice(
            ActivationQuantization, activation_quantization, "activation_quantization"
        )
        load_format = parse_choice(LoadFormat, load_format, "load_format")
        quantization = parse_choice(Quantization, quantization, "quantization")
    except ValueError as error:
        raise ModelLoadError(str(error)) from None
    if load_format is LoadFormat.DUMMY:
        if quantization.rounds:
            raise ModelLoadError(
                f"quantization={quantization.value!r} needs a checkpoint, not dummy weights"
            )
        config, decoder, source = load_dummy_model(
            model, dtype, device, linear_kernel=linear_kernel, parallel=parallel
        )
        _finish(decoder, activation_quantization)
        return LoadedModel(model=decoder.eval(), config=config, tokenizer=None, source=source)
    is_default = model is None or model == "default"
    path = default_model_path() if is_default else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        exact_blocks = quantization is Quantization.AUTO and (
            activation_quantization is ActivationQuantization.NONE
        )
        budget = weight_expansion_memory if exact_blocks else 0
        config, decoder, has_tokenizer = _load_gguf_weights(
            path, dtype, device, quantization, linear_kernel, parallel, budget
        )
        tokenizer = Tokenizer.from_gguf(path, config.eos_token_ids) if has_tokenizer else None
    elif (path / "config.json").is_file():
        config, decoder = load_safetensors_model(
            path, dtype, device, quantization, linear_kernel, parallel
        )
        has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
        eos_ids = config.eos_token_ids + generation_eos_ids(path)
        tokenizer = Tokenizer.from_folder(path, eos_ids) if has_tokenizer else None
    else:
        raise ModelLoadError(
            f"{model!r} is neither a .gguf file nor a folder with config.json "
            "(models are never downloaded; pass a local path, or load_format='dummy' "
            "with a preset name for random weights)"
        )
    _finish(decoder, activation_quantization)
    decoder.eval()
    return LoadedModel(model=decoder, config=config, tokenizer=tokenizer, source=path)


def _finish(decoder: CausalDecoder, activation_quantization: str) -> None:
    """Switch the weights to int8 activations if asked; then, on the CPU, every weight
    into one arena in forward order (see :mod:`pagedllm.models.weight_arena`), the memory
    they leave given back to the OS."""
    if activation_quantization is ActivationQuantization.INT8:
        quantize_activations(decoder)
    if decoder.device.type == "cpu" and move_into_arena(decoder.weights()) is not None:
        release_free_memory()


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(
            f"unsupported dtype {dtype}; use torch.float32, torch.bfloat16 or torch.float16"
        )


def _load_gguf_weights(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    linear_kernel: str,
    parallel: TensorParallelGroup | None,
    expansion_budget: int,
) -> tuple[ModelConfig, CausalDecoder, bool]:
    """Config, decoder and whether the file holds a tokenizer; the parsed file is
    released before the tokenizer parses it again, to keep peak memory down."""
    reader = open_gguf(path)
    config, decoder = load_gguf_model(
        path, dtype, reader, device, quantization, linear_kernel, parallel, expansion_budget
    )
    return config, decoder, "tokenizer.ggml.model" in reader.fields
