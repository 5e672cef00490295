"""The plan as a readable text table or a JSON document (exact bytes, no rounding)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.kv.capacity import grouped_worst_case_blocks, request_worst_case_blocks
from pagedllm.kv_storage.kv_quant import SCALE_BYTES
from pagedllm.models.partition import TensorPartition
from pagedllm.plan.capacity import (
    PLANNED_KV_DTYPES,
    CapacityPlan,
    DtypeCapacity,
    Tiers,
    block_elements_per_layer,
    hidden_size_estimate,
    kv_bytes_per_token,
    layer_groups,
)

QUANTIZED_SCALES = (
    f"fp8 and int8 rows carry one bfloat16 scale ({SCALE_BYTES} bytes) per token, layer, K/V "
    "and KV head, stored beside the codes"
)


def decimal_bytes(num_bytes: float) -> str:
    """``8589934592`` -> ``"8.59 GB"`` (powers of 1000, as memory sizes are sold)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def binary_bytes(num_bytes: float) -> str:
    """``262144`` -> ``"256 KiB"`` (powers of 1024, natural for block sizes)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.4g} {unit}"
    return f"{num_bytes:,.0f} B"


def gqa_explanation(plan: CapacityPlan) -> str:
    """Why the KV width is ``kv_heads x head_dim``, and what the textbook formula (with the
    hidden size as the width) gets wrong, for the whole model (all devices)."""
    config = plan.model.config
    kv_width = config.num_kv_heads * config.head_dim
    ratio = f"{config.num_kv_heads}/{config.num_heads}"
    if config.num_kv_heads == config.num_heads and kv_width == config.hidden_size:
        return (
            f"kv_heads/heads = {ratio}: no grouped-query attention, so the K/V width "
            f"kv_heads x head_dim = {kv_width:,} equals the hidden size and the formula "
            "2 x layers x tokens x hidden x bytes is exact."
        )
    workload, kv_dtype = plan.workload, PLANNED_KV_DTYPES[plan.rows[0].kv_dtype]
    num_tokens = workload.batch * workload.avg_len
    batch_bytes = num_tokens * kv_bytes_per_token(config, kv_dtype)
    naive = hidden_size_estimate(config, num_tokens, kv_dtype.element_bytes)
    return (
        f"kv_heads/heads = {ratio}: the K/V width is kv_heads x head_dim = {kv_width:,}, "
        f"not the hidden size {config.hidden_size:,}. The formula 2 x layers x tokens x "
        f"hidden x bytes assumes kv_heads == heads; multiply it by {ratio} "
        f"(batch {workload.batch} x {workload.avg_len:,} tokens in {kv_dtype.name}: "
        f"{decimal_bytes(batch_bytes)}, not {decimal_bytes(naive)})."
    )


PER_DEVICE = (
    "budget, kv_dtypes and block_elements_per_layer are per device: the weights of the "
    "device holding the most, the KV cache of the device with the most KV heads (all "
    "devices hold the same blocks); budget.weight_bytes_all_devices sums every device"
)


def kv_heads_per_device(plan: CapacityPlan) -> list[int]:
    """KV heads each device holds, device by device (a replicated head on each of its devices)."""
    partition = TensorPartition(plan.model.config, plan.tensor_parallel_size)
    return [len(partition.rank_slice(r).kv_heads) for r in range(plan.tensor_parallel_size)]


def _parallel_line(plan: CapacityPlan) -> str:
    n, config, device = plan.tensor_parallel_size, plan.model.config, plan.kv_config
    line = (
        f"tensor parallel over {n} devices; every figure below is per device. KV heads per "
        f"device {'+'.join(map(str, kv_heads_per_device(plan)))}"
    )
    if config.num_kv_heads < n:
        line += f" (each KV head replicated on {n // config.num_kv_heads} devices)"
    return line + (
        f"; the device with the most KV heads holds {device.num_heads} query heads and "
        f"{device.intermediate_size:,} of {config.intermediate_size:,} MLP features; "
        f"vocabulary shards of {TensorPartition(config, n).vocab_shard:,} rows"
    )


def _weights(plan: CapacityPlan) -> str:
    budget, n = plan.budget, plan.tensor_parallel_size
    params = f"{plan.model.num_parameters / 1e9:.3g} B params in {budget.weight_dtype}"
    if n > 1:
        params = (
            f"{budget.device_parameters / 1e9:.3g} B of the {params}; "
            f"{decimal_bytes(budget.weight_bytes_all_devices)} on the {n} devices"
        )
    return f"weights {decimal_bytes(budget.weight_bytes)} ({params})"


def _per_device(plan: CapacityPlan) -> str:
    return " on each device" if plan.tensor_parallel_size > 1 else ""


def _memory_line(plan: CapacityPlan) -> str:
    budget = plan.budget
    weights = _weights(plan)
    reserve = (
        f"activation reserve {decimal_bytes(budget.activation_reserve_bytes)} "
        f"({budget.activation_reserve:.0%} of weights)"
    )
    if budget.total_bytes is None:
        return (
            f"KV cache budget {decimal_bytes(budget.kv_bytes)} ({budget.kv_bytes:,} bytes), "
            f"given directly; {weights} and {reserve} come on top"
        )
    memory = f"{decimal_bytes(budget.total_bytes)}{_per_device(plan) or ' total'}"
    return f"{memory} = {weights} + {reserve} + KV cache {decimal_bytes(budget.kv_bytes)}"


def _draft_line(plan: CapacityPlan) -> str:
    draft, size = plan.draft, plan.block_size
    return (
        f"{draft.model.name} ({draft.model.num_parameters / 1e9:.3g} B params in "
        f"{draft.weight_dtype}, {decimal_bytes(draft.weight_bytes)}, in the weights above); "
        f"its {draft.kv_dtype} K/V add {draft.block_bytes(size):,} bytes to every block "
        f"(in the tables below), and its scratch blocks take "
        f"{decimal_bytes(draft.scratch_bytes(size))} of the KV budget"
    )


def _workload_line(plan: CapacityPlan) -> str:
    workload = plan.workload
    line = (
        f"blocks of {plan.block_size} tokens; sequences of {workload.avg_len:,} tokens on "
        f"average; contiguous allocation reserves {workload.max_model_len:,} tokens per sequence"
    )
    if workload.max_model_len > plan.model.max_context:
        line += " (beyond the model's context)"
    if workload.prefix_len:
        line += f"; the first {workload.prefix_len:,} tokens are a prefix all sequences share"
    window = plan.model.config.kv_window
    groups = layer_groups(plan.model.config)
    if window is not None:
        held = request_worst_case_blocks(0, workload.avg_len, 1, plan.block_size, window=window)
        line += (
            f"; every layer slides over {window:,} tokens, so a paged sequence holds at most "
            f"{held:,} blocks (older ones go back to the pool)"
        )
    elif groups.num_groups > 1:
        held = grouped_worst_case_blocks(0, workload.avg_len, 1, plan.block_size, groups.windows)
        line += (
            f"; {groups.describe()}, so a paged sequence holds at most {held:,} blocks of "
            f"{groups.num_slots} layers (sliding groups give older ones back)"
        )
    return line


def _by_age_line(plan: CapacityPlan, row: DtypeCapacity) -> str:
    by_age = plan.by_age
    dtype = by_age.full_kv_dtype.name
    return (
        f"{row.kv_dtype} keeps each sequence's newest {by_age.recent_tokens:,} tokens in "
        f"full-size {dtype} blocks and re-encodes older blocks into 4 bits (keys per channel "
        f"over a block, values per token, scales and zeros included): "
        f"{binary_bytes(row.compact_block_bytes)} per compact block against "
        f"{binary_bytes(row.block_bytes)}; the pool holds {row.num_blocks:,} full-size blocks "
        f"(for {by_age.max_num_seqs} sequences' windows and two steps of "
        f"{by_age.max_num_batched_tokens:,} tokens, at most a quarter of the budget) and "
        f"{row.num_compact_blocks:,} compact ones; 'KV per token' is a compact token's"
    )


def _blocks(row: DtypeCapacity) -> str:
    if row.num_compact_blocks:
        return f"{row.num_blocks:,} + {row.num_compact_blocks:,} compact"
    return f"{row.num_blocks:,}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (header, *rows)
    ]


def _block_label(plan: CapacityPlan) -> str:
    """What one block of the plan's pool spans: every layer, or one KV layer group's."""
    groups = layer_groups(plan.model.config)
    if groups.num_groups == 1:
        return "block, all layers"
    return f"block, a group's {groups.num_slots} layers"


def _per_token_rows(plan: CapacityPlan) -> list[str]:
    elements = block_elements_per_layer(plan.kv_config, plan.block_size)
    workload = plan.workload
    header = [
        "KV dtype",
        "bytes/elem",
        "KV per token",
        f"block per layer ({elements:,} elements)",
        _block_label(plan),
        f"batch {workload.batch} x {workload.avg_len:,} tokens",
    ]
    rows = [
        [
            row.kv_dtype,
            "0.5" if row.num_compact_blocks else str(row.element_bytes),
            f"{row.kv_bytes_per_token:,} B",
            binary_bytes(row.block_bytes_per_layer),
            binary_bytes(row.block_bytes),
            decimal_bytes(row.batch_kv_bytes),
        ]
        for row in plan.rows
    ]
    return _table(header, rows)


def _ratio(row: DtypeCapacity) -> str:
    return f"{row.paged_seqs / row.contiguous_seqs:.1f}x" if row.contiguous_seqs else "-"


def _capacity_rows(plan: CapacityPlan) -> list[str]:
    workload = plan.workload
    header = [
        "KV dtype",
        "blocks",
        "tokens" if _block_label(plan) == "block, all layers" else "block slots",
        f"paged seqs @ {workload.avg_len:,}",
        f"contiguous seqs @ {workload.max_model_len:,}",
        "paged/contiguous",
    ]
    if workload.prefix_len:
        header.insert(4, f"paged, {workload.prefix_len:,}-token shared prefix")
    rows = []
    for row in plan.rows:
        cells = [
            row.kv_dtype,
            _blocks(row),
            f"{row.num_tokens:,}",
            f"{row.paged_seqs:,}",
            f"{row.contiguous_seqs:,}",
            _ratio(row),
        ]
        if workload.prefix_len:
            cells.insert(4, f"{row.paged_seqs_with_prefix:,}")
        rows.append(cells)
    return _table(header, rows)


def format_text(plan: CapacityPlan) -> str:
    """The plan as aligned tables with a few lines of context."""
    config = plan.model.config
    model = (
        f"{plan.model.name}: {config.num_layers} layers, {config.num_heads} heads, "
        f"{config.num_kv_heads} KV heads x {config.head_dim} dims (hidden "
        f"{config.hidden_size:,}), {plan.model.num_parameters / 1e9:.3g} B parameters, "
        f"max context {plan.model.max_context:,} tokens"
    )
    lines = [
        f"Model     {model}",
        f"GQA       {gqa_explanation(plan)}",
    ]
    if plan.tensor_parallel_size > 1:
        lines.append(f"Devices   {_parallel_line(plan)}")
    lines += [f"Memory    {_memory_line(plan)}", f"Workload  {_workload_line(plan)}"]
    if plan.draft is not None:
        lines.append(f"Draft     {_draft_line(plan)}")
    if any(PLANNED_KV_DTYPES[row.kv_dtype].quantized for row in plan.rows):
        lines.append(f"Scales    {QUANTIZED_SCALES} (in '{_block_label(plan)}' and the counts)")
    lines += [f"By age    {_by_age_line(plan, row)}" for row in plan.rows if row.num_compact_blocks]
    lines += ["", f"KV cache per token and per block{_per_device(plan)}", *_per_token_rows(plan)]
    kv_budget = decimal_bytes(plan.budget.kv_bytes)
    lines += ["", f"Capacity of {kv_budget} of KV cache{_per_device(plan)}"]
    lines += _capacity_rows(plan)
    if plan.tiers is not None:
        lines += ["", f"Below the pool: {_tiers_line(plan.tiers)}", *_tier_rows(plan)]
    return "\n".join(lines)


def _tiers_line(tiers: Tiers) -> str:
    host = (
        f"host memory {decimal_bytes(tiers.memory)}"
        if tiers.memory
        else "a host staging tier of two max-model-len prompts"
    )
    disk = "" if tiers.dir_size is None else f", a directory of {decimal_bytes(tiers.dir_size)}"
    return (
        f"the prefix cache's lower tiers, {host}{disk}: blocks the pool evicts, kept to be "
        "found again (int4 has none: two block kinds)"
    )


def _tier_rows(plan: CapacityPlan) -> list[str]:
    header = ["KV dtype", "block", "host blocks", "host tokens", "disk blocks", "disk tokens"]
    rows = []
    for row in plan.rows:
        t = row.tiers
        if t is None:
            rows.append([row.kv_dtype, *["-"] * 5])
            continue
        rows.append(
            [
                row.kv_dtype,
                binary_bytes(t.block_bytes),
                f"{t.host_blocks:,}",
                f"{t.host_tokens:,}",
                f"{t.disk_blocks:,}",
                f"{t.disk_tokens:,}",
            ]
        )
    return _table(header, rows)


def to_json(plan: CapacityPlan) -> dict[str, Any]:
    """The plan as plain data: every size in bytes, lengths in tokens."""
    config = plan.model.config
    return {
        "model": {
            "name": plan.model.name,
            "num_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "num_parameters": plan.model.num_parameters,
            "max_context": plan.model.max_context,
            "gqa_ratio": plan.model.gqa_ratio,
        },
        "tensor_parallel_size": plan.tensor_parallel_size,
        "kv_heads_per_device": kv_heads_per_device(plan),
        "per_device": PER_DEVICE,
        "block_size": plan.block_size,
        "block_elements_per_layer": block_elements_per_layer(plan.kv_config, plan.block_size),
        "budget": dataclasses.asdict(plan.budget),
        "workload": dataclasses.asdict(plan.workload),
        "assumptions": {"quantized_scales": QUANTIZED_SCALES},
        "kv_dtypes": [dataclasses.asdict(row) for row in plan.rows],
        "draft": None if plan.draft is None else _draft_json(plan),
        "tiers": None if plan.tiers is None else dataclasses.asdict(plan.tiers),
    }


def _draft_json(plan: CapacityPlan) -> dict[str, Any]:
    draft, size = plan.draft, plan.block_size
    return {
        "name": draft.model.name,
        "num_parameters": draft.model.num_parameters,
        "weight_dtype": draft.weight_dtype,
        "weight_bytes": draft.weight_bytes,
        "kv_dtype": draft.kv_dtype,
        "block_bytes": draft.block_bytes(size),
        "scratch_bytes": draft.scratch_bytes(size),
        "num_speculative_tokens": draft.num_speculative_tokens,
    }
