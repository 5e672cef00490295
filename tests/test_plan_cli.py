"""``pagedllm plan`` end to end: model sources, text and JSON output, the layout picture,
and the block count the engine really allocates."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.cli import main
from pagedllm.config import EngineConfig
from pagedllm.models.presets import PRESETS
from pagedllm.plan.model_shape import resolve_model


def run_plan(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_text_output_shows_the_seed_examples(capsys):
    out = run_plan(capsys, "llama-2-7b", "--kv-dtype", "float16", "--batch", "8")
    assert "131,072 elements" in out and "256 KiB" in out
    assert "8.59 GB" in out
    assert "no grouped-query attention" in out
    out = run_plan(
        capsys,
        "llama-2-7b",
        "--kv-dtype",
        "float16",
        "--avg-len",
        "8192",
        "--max-model-len",
        "8192",
    )
    assert "34.36 GB" in out and "beyond the model's context" in out


def test_text_output_explains_the_gqa_correction(capsys):
    out = run_plan(capsys, "llama-3-8b", "--kv-dtype", "bfloat16")
    assert "multiply it by 8/32" in out
    assert "2.15 GB, not 8.59 GB" in out


def test_json_output_with_total_memory_and_shared_prefix(capsys):
    out = run_plan(
        capsys,
        "llama-3-70b",
        "--json",
        "--memory",
        "320GB",
        "--weight-dtype",
        "fp8",
        "--activation-reserve",
        "0.1",
        "--avg-len",
        "1000",
        "--prefix-len",
        "500",
    )
    plan = json.loads(out)
    params = PRESETS["llama-3-70b"].num_parameters
    assert plan["model"]["num_parameters"] == params
    budget = plan["budget"]
    assert budget["weight_bytes"] == params
    assert budget["kv_bytes"] == 320 * 10**9 - params - budget["activation_reserve_bytes"]
    rows = {row["kv_dtype"]: row for row in plan["kv_dtypes"]}
    assert set(rows) == {"float32", "bfloat16", "float16", "fp8", "int8", "int4"}
    bf16 = rows["bfloat16"]
    assert bf16["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert bf16["paged_seqs_with_prefix"] > bf16["paged_seqs"] > bf16["contiguous_seqs"]


def test_unknown_model_or_dtype_is_a_clear_error(capsys):
    assert main(["plan", "no-such-model"]) == 2
    assert "not a preset" in capsys.readouterr().err
    assert main(["plan", "llama-3-8b", "--kv-dtype", "int3"]) == 2
    assert "unknown KV dtype" in capsys.readouterr().err


def test_hf_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen2-7b"].hf_config))
    for source in (tmp_path, tmp_path / "config.json"):
        shape = resolve_model(str(source))
        assert shape.config.num_kv_heads == 4
        assert shape.num_parameters == PRESETS["qwen2-7b"].num_parameters


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "layout.png"
    run_plan(
        capsys,
        "smollm2-135m",
        "--max-model-len",
        "512",
        "--avg-len",
        "200",
        "--prefix-len",
        "40",
        "--plot",
        str(path),
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        main(
            [
                "plan",
                "smollm2-135m",
                "--max-model-len",
                "512",
                "--lengths",
                "600",
                "--plot",
                str(path),
            ]
        )
        == 2
    )


@pytest.mark.slow
def test_default_model_blocks_equal_what_the_engine_allocates(capsys, default_model):
    from pagedllm.engine.llm_engine import LLMEngine

    budget = 300_000_000
    config = EngineConfig(dtype="float32", kv_cache_memory=budget, log_stats_interval=0)
    engine = LLMEngine(config, default_model)
    plan = json.loads(run_plan(capsys, "--json", "--kv-cache-memory", str(budget)))
    config = engine.model_config
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    assert (
        plan["model"]["num_layers"],
        plan["model"]["num_kv_heads"],
        plan["model"]["head_dim"],
    ) == shape
    rows = {row["kv_dtype"]: row for row in plan["kv_dtypes"]}
    assert engine.config.dtype == torch.float32
    assert rows["float32"]["num_blocks"] == engine.num_blocks == engine.kv_cache.num_blocks
    assert rows["float32"]["block_bytes"] * engine.num_blocks == engine.kv_cache.nbytes


def test_one_device_is_the_default_plan(capsys):
    for argv in (["llama-3-8b"], ["llama-3-8b", "--json"]):
        default = run_plan(capsys, *argv)
        assert run_plan(capsys, *argv, "--tensor-parallel-size", "1") == default
    assert "Devices" not in default and json.loads(default)["tensor_parallel_size"] == 1


def test_two_devices_json_is_per_device(capsys):
    """Llama-3-8B over 2 devices: each holds half of every split tensor plus all 65 norms
    of 4,096 weights: (8,030,261,248 + 65 x 4,096) / 2 parameters."""
    argv = ("llama-3-8b", "--json", "--memory", "40GB", "--activation-reserve", "0.1")
    one = json.loads(run_plan(capsys, *argv))
    two = json.loads(run_plan(capsys, *argv, "--tensor-parallel-size", "2"))
    assert two["tensor_parallel_size"] == 2 and two["kv_heads_per_device"] == [4, 4]
    assert "per device" in two["per_device"]
    budget = two["budget"]
    assert budget["device_parameters"] == 4_015_263_744
    assert budget["weight_bytes"] == 2 * 4_015_263_744
    assert budget["weight_bytes_all_devices"] == 4 * 4_015_263_744
    assert (
        budget["kv_bytes"]
        == 40 * 10**9 - budget["weight_bytes"] - budget["activation_reserve_bytes"]
    )
    assert two["block_elements_per_layer"] == one["block_elements_per_layer"] // 2
    for row_one, row_two in zip(one["kv_dtypes"], two["kv_dtypes"], strict=True):
        assert row_two["kv_bytes_per_token"] == row_one["kv_bytes_per_token"] // 2
        if row_two["num_compact_blocks"]:  # int4: a quarter of the budget at most is full
            compact = row_two["num_compact_blocks"] * row_two["compact_block_bytes"]
            assert row_two["num_blocks"] * row_two["block_bytes"] <= budget["kv_bytes"] // 4
            assert (
                budget["kv_bytes"] - compact
                < row_two["block_bytes"] * row_two["num_blocks"] + row_two["compact_block_bytes"]
            )
        else:
            assert row_two["num_blocks"] == budget["kv_bytes"] // row_two["block_bytes"]


def test_two_devices_text_says_per_device_and_the_kv_split(capsys, tmp_path):
    out = run_plan(capsys, "smollm2-135m", "--tensor-parallel-size", "2", "--kv-dtype", "bfloat16")
    assert "tensor parallel over 2 devices; every figure below is per device" in out
    assert "KV heads per device 2+1;" in out and "6 query heads" in out
    assert "Capacity of 2.15 GB of KV cache on each device" in out
    one_kv_head = {**PRESETS["smollm2-135m"].hf_config, "num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(one_kv_head))
    out = run_plan(capsys, str(tmp_path), "--tensor-parallel-size", "3")
    assert "KV heads per device 1+1+1 (each KV head replicated on 3 devices)" in out


def test_a_split_the_partition_refuses_is_a_clear_error(capsys):
    assert main(["plan", "smollm2-135m", "--tensor-parallel-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "3 KV heads and 9 query heads cannot be split over 4 ranks" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("memory", [3 << 20, 0])
def test_the_lower_tiers_hold_the_blocks_the_engine_gives_them(
    capsys, tiny_model, tmp_path, memory
):
    """Host memory (or, without, the staging tier of two prompts of the engine's
    max_model_len, here what its small pool holds) and a directory: the plan's blocks
    per tier are the engine's, and int4 has none."""
    from tiny_checkpoints import tiny_engine

    options = dict(kv_cache_dir=str(tmp_path / "kv"), kv_cache_dir_size=5 << 20)
    if memory:
        options["kv_tier_memory"] = memory
    engine = tiny_engine(tiny_model, 40, **options)
    argv = ["--json", "--kv-dtype", "float32,int4", "--block-size", "4"]
    argv += ["--kv-cache-dir-size", str(5 << 20), "--max-model-len", str(engine.max_model_len)]
    if memory:
        argv += ["--kv-tier-memory", str(memory)]
    plan = json.loads(run_plan(capsys, str(tiny_model.source), *argv))
    float32, int4 = plan["kv_dtypes"]
    tiers = engine.tiers
    assert float32["tiers"]["block_bytes"] == tiers.host.block_bytes
    assert float32["tiers"]["host_blocks"] == tiers.host.num_slots > 0
    assert float32["tiers"]["disk_blocks"] == tiers.disk.capacity_entries > 0
    assert int4["tiers"] is None
    assert plan["tiers"] == {"memory": memory, "dir_size": 5 << 20}


def test_tiers_with_two_devices_are_refused(capsys):
    assert main(["plan", "llama-3-8b", "--tensor-parallel-size", "2", "--kv-tier-memory", "1GiB"])
    assert "lower tiers run on one rank" in capsys.readouterr().err
