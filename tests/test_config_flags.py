"""Engine flags come from EngineConfig's fields: every knob on every command, one source
for names, defaults and help, and the README lists every knob."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from pagedllm.cli import build_parser
from pagedllm.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig, PreemptionMode
from pagedllm.config_flags import config_from_flags, flag_name
from pagedllm.kv_storage.kv_quant import KVCacheDtype

FIELDS = [spec.name for spec in fields(EngineConfig)]


@pytest.mark.parametrize("command", ["serve", "bench", "generate", "chat"])
def test_every_knob_has_a_flag_on_every_command(command):
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    parser = subparsers.choices[command]
    flags = {option for action in parser._actions for option in action.option_strings}
    expected = {flag_name(name) for name in FIELDS if not (command == "bench" and name == "dtype")}
    assert expected <= flags


def test_flags_build_the_config_they_name():
    args = build_parser().parse_args(
        [
            "serve",
            "--block-size", "8",
            "--kv-cache-memory", "64MiB",
            "--max-model-len", "256",
            "--no-enable-prefix-caching",
            "--kv-allocation", "contiguous",
            "--reserved-fraction", "0",
            "--max-n", "4",
            "--seed", "7",
        ]
    )  # fmt: skip
    config = config_from_flags(args)
    assert (config.block_size, config.kv_cache_memory, config.max_model_len) == (8, 64 << 20, 256)
    assert not config.enable_prefix_caching and config.kv_allocation == "contiguous"
    assert (config.reserved_fraction, config.max_n, config.seed) == (0.0, 4, 7)
    defaults = config_from_flags(build_parser().parse_args(["serve"]))
    assert defaults == EngineConfig()


def test_bad_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-allocation", "banana"])
    assert "invalid choice" in capsys.readouterr().err


def test_readme_names_every_knob():
    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    named = set(re.findall(r"`([a-z_]+)`", readme))
    assert set(FIELDS) <= named, sorted(set(FIELDS) - named)


def test_text_knobs_are_parsed_into_their_final_types_once():
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        kv_cache_memory="1.5GiB",
        swap_space="512MB",
        preemption_mode="swap",
        kv_cache_dtype="int8",
    )
    assert config.device == torch.device("cpu") and config.dtype is torch.float32
    assert (config.kv_cache_memory, config.swap_space) == (3 << 29, 512 * 1000**2)
    assert type(config.preemption_mode) is PreemptionMode
    assert type(config.kv_cache_dtype) is KVCacheDtype
    # constructing again from the final values (dataclasses.replace) keeps them
    assert dataclasses.replace(config) == config
    assert EngineConfig(device="cpu").kv_cache_memory == DEFAULT_CPU_KV_CACHE_MEMORY


@pytest.mark.parametrize(
    ("knob", "value", "message"),
    [
        ("kv_cache_memory", "0", "kv_cache_memory must be positive"),
        ("kv_cache_memory", "lots", "cannot read a memory size"),
        ("swap_space", -1, "swap_space must be >= 0"),
        ("dtype", "float64", "dtype 'float64' is not supported"),
        ("device", "tpu", "device must be"),
        ("preemption_mode", "drop", "preemption_mode must be one of recompute, swap, auto"),
    ],
)
def test_bad_knob_text_is_refused_naming_the_knob(knob, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"device": "cpu", knob: value})
