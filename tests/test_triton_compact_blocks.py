"""The Triton kernels over block tables that mix full-size and compact 4-bit blocks
(``kv_cache_dtype="int4"``): decode and prefill against the oracle that decodes every
block (as ``PagedAttentionBackend._by_age`` does without its C++ kernel), and the whole
engine over the Triton backend against the C++ backend.

Without CUDA they run on CPU tensors under Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``). The kernels score compact keys, stored rotated, against the
rotated query, the oracle the keys rotated back against the query, so even float32
differs by rounding; tolerances as in test_triton_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

import pagedllm.engine.model_worker as model_worker  # noqa: E402
from pagedllm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.reference import reference_paged_attention  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.gpu.compact_tiles import CompactOperands  # noqa: E402
from pagedllm.gpu.triton_decode import decode_attention  # noqa: E402
from pagedllm.gpu.triton_prefill import prefill_attention  # noqa: E402
from pagedllm.kv.capacity import cdiv  # noqa: E402
from pagedllm.kv_storage.compact_blocks import decode_tiles  # noqa: E402
from pagedllm.kv_storage.int4_codec import hadamard  # noqa: E402
from pagedllm.kv_storage.kv_cache import KVCache  # noqa: E402
from pagedllm.kv_storage.kv_quant import decode_rows, encode_rows  # noqa: E402
from pagedllm.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class MixedCase:
    """A batch over a one-layer cache whose every full block and compact tile holds
    random K/V; sequence ``i``'s table starts with its compact blocks."""

    cache: KVCache
    q: torch.Tensor  # on the CPU
    metadata: AttentionMetadata  # on the CPU
    scale: float


def mixed_case(
    seq_lens: list[int],
    query_lens: list[int],
    compact_blocks: list[int],
    block: int,
    hq: int,
    hkv: int,
    dim: int,
    dtype: torch.dtype,
    seed: int,
    shared_compact: int = 0,
    full_format: str = "int4",
) -> MixedCase:
    """Sequence ``i`` has ``compact_blocks[i]`` compact blocks, then full ones (its last
    one partly filled unless its length is a multiple of ``block``); sequence 1 shares
    sequence 0's first ``shared_compact`` compact blocks (a cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [cdiv(n, block) for n in seq_lens]
    num_full = sum(blocks) + 3  # the last one is the null block, never in a table
    num_compact = sum(compact_blocks) + 2
    cache = KVCache(1, num_full, block, hkv, dim, dtype, DEVICE, full_format, num_compact)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    rows = (num_full, hkv, block, dim)  # full blocks in the cache's format (int8: codes)
    cache.stored_key(0).copy_(encode_rows(randn(*rows), cache.format).view(cache.dtype))
    cache.stored_value(0).copy_(encode_rows(randn(*rows), cache.format).view(cache.dtype))
    channel_spread = 0.2 + 3 * torch.rand(dim, generator=gen).to(DEVICE)  # unequal channels
    tile_shape = (num_compact, hkv, block, dim)
    cache.compact.write(
        0, torch.arange(num_compact, device=DEVICE), randn(*tile_shape) * channel_spread,
        randn(*tile_shape),
    )  # fmt: skip
    full_ids = torch.randperm(num_full - 1, generator=gen).tolist()
    # never the last tile: an id one off still names a tile (test_a_wrong_compact_offset...)
    compact_ids = torch.randperm(num_compact - 1, generator=gen).tolist()
    tables = []
    for i, (n, c) in enumerate(zip(blocks, compact_blocks, strict=True)):
        shared = tables[0][: min(shared_compact, c)] if i == 1 else []
        own = [cache.compact_offset + compact_ids.pop() for _ in range(c - len(shared))]
        tables.append(shared + own + [full_ids.pop() for _ in range(n - c)])
    block_tables = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((int(starts[-1]),), -1, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=starts,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    q = torch.randn(int(starts[-1]), hq, dim, generator=gen).to(dtype)
    return MixedCase(cache, q, metadata, dim**-0.5)


def expected(case: MixedCase, window: int | None = None, softcap: float | None = None):
    """The oracle: every block decoded, compact ids indexing the decoded compact blocks
    appended after the full ones."""
    cache = case.cache
    tiles = cache.compact.tiles(0).cpu()
    compact_keys, compact_values = decode_tiles(tiles, cache.block_size, cache.head_dim)
    keys = torch.cat([decode_rows(cache.key(0).cpu(), cache.format).float(), compact_keys])
    values = torch.cat([decode_rows(cache.value(0).cpu(), cache.format).float(), compact_values])
    return reference_paged_attention(case.q, keys, values, case.metadata, case.scale, window,
                                     softcap)  # fmt: skip


def attend(case: MixedCase, offset: int | None = None, **options) -> torch.Tensor:
    """The decode kernel for a decode-only batch, else the prefill kernel, over the
    case's cache (compact blocks from ``offset`` on, the cache's own by default)."""
    cache, meta = case.cache, case.metadata
    q = case.q.to(DEVICE)
    rotated = q.float() @ hadamard(cache.head_dim).to(DEVICE)
    compact = CompactOperands(
        cache.compact.tiles(0), cache.compact_offset if offset is None else offset, rotated
    )
    tables, lens = meta.block_tables.to(DEVICE), meta.seq_lens.to(DEVICE)
    kv = (cache.stored_key(0), cache.stored_value(0))
    if meta.is_decode_only:
        return decode_attention(q, *kv, tables, lens, meta.max_seq_len, case.scale, cache.format,
                                compact=compact, **options).cpu()  # fmt: skip
    starts = meta.query_start_loc.to(DEVICE)
    return prefill_attention(q, *kv, tables, lens, starts, meta.max_query_len, case.scale,
                             cache.format, compact=compact, **options).cpu()  # fmt: skip


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype and got.shape == want.shape
    return (got.float() - want.float()).abs().max().item()


# (block_size, q heads, kv heads, head_dim, query and cache dtype): GQA 4, MHA, MQA
SHAPES = [
    (16, 8, 2, 64, torch.bfloat16),
    (16, 4, 4, 128, torch.float32),
    (32, 8, 1, 32, torch.float16),
    (64, 4, 2, 128, torch.float32),  # 5-bit keys
]
# compact blocks then full (the last partly filled), all compact, none compact, and a
# sequence sharing the first's compact prefix
SEQ_LENS = [150, 64, 77, 33]
COMPACT_BLOCKS = {16: [5, 4, 3, 0], 32: [2, 2, 2, 0], 64: [2, 1, 1, 0]}


@pytest.mark.parametrize(("block", "hq", "hkv", "dim", "dtype"), SHAPES)
def test_decode_over_mixed_tables_matches_reference(block, hq, hkv, dim, dtype):
    """Splits of 2 blocks cross from compact blocks to full ones."""
    case = mixed_case(SEQ_LENS, [1] * 4, COMPACT_BLOCKS[block], block, hq, hkv, dim, dtype,
                      seed=block + dim, shared_compact=2)  # fmt: skip
    assert max_error(attend(case, split_tokens=2 * block), expected(case)) <= TOLERANCE[dtype]
    assert max_error(attend(case), expected(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize(("block", "hq", "hkv", "dim", "dtype"), SHAPES)
def test_prefill_over_mixed_tables_matches_reference(block, hq, hkv, dim, dtype):
    """One launch: chunks after compact (and full) blocks, rows within compact blocks
    only, a whole prompt over full blocks."""
    case = mixed_case(SEQ_LENS, [23, 10, 13, 33], COMPACT_BLOCKS[block], block, hq, hkv, dim,
                      dtype, seed=block + hq, shared_compact=2)  # fmt: skip
    assert max_error(attend(case, block_m=32), expected(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("query_lens", [[1] * 4, [23, 10, 13, 33]], ids=["decode", "prefill"])
def test_sliding_window_and_softcap_over_mixed_tables(query_lens):
    case = mixed_case(SEQ_LENS, query_lens, COMPACT_BLOCKS[16], 16, 4, 2, 64, torch.float32,
                      seed=5)  # fmt: skip
    options = dict(sliding_window=40, logit_softcap=5.0)
    want = expected(case, window=40, softcap=5.0)
    assert max_error(attend(case, **options), want) <= 1e-5


@pytest.mark.parametrize("full_format", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("query_lens", [[1] * 4, [23, 10, 13, 33]], ids=["decode", "prefill"])
def test_an_8_bit_recent_window_beside_compact_blocks(full_format, query_lens):
    """``kv_recent_dtype``: full blocks in 8 bits, decoded by the kernels as a plain
    8-bit cache's are, beside the compact ones."""
    case = mixed_case(SEQ_LENS, query_lens, COMPACT_BLOCKS[16], 16, 4, 2, 64, torch.float32,
                      seed=8, full_format=full_format)  # fmt: skip
    assert case.cache.format.quantized and case.cache.compact is not None
    assert max_error(attend(case), expected(case)) <= 1e-5


def test_float32_cache_under_a_bfloat16_query():
    """The dot products then run in float32 (kernel_dtypes.dot_dtype)."""
    case = mixed_case(SEQ_LENS, [1] * 4, COMPACT_BLOCKS[16], 16, 4, 2, 64, torch.float32, seed=6)
    case.q = case.q.to(torch.bfloat16)
    assert max_error(attend(case), expected(case)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("query_lens", [[1] * 4, [23, 10, 13, 33]], ids=["decode", "prefill"])
def test_a_wrong_compact_offset_fails_the_comparison(query_lens):
    """One off: every compact entry reads its neighbour's tile (every tile holds K/V)."""
    case = mixed_case(SEQ_LENS, query_lens, COMPACT_BLOCKS[16], 16, 4, 2, 64, torch.float32,
                      seed=7)  # fmt: skip
    want = expected(case)
    assert max_error(attend(case), want) <= 1e-5
    assert max_error(attend(case, offset=case.cache.compact_offset - 1), want) > 0.1


def test_launchers_take_one_block_per_tile_over_compact_blocks():
    case = mixed_case([40], [1], [1], 16, 4, 2, 64, torch.float32, seed=8)
    with pytest.raises(ValueError, match="one block"):
        attend(case, tile_tokens=32)
    case = mixed_case([40], [3], [1], 16, 4, 2, 64, torch.float32, seed=8)
    with pytest.raises(ValueError, match="one block"):
        attend(case, block_n=32)


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int4_engine(loaded, device: str, **settings) -> LLMEngine:
    """int4 K/V by age over 16-token blocks, all but each sequence's last 5 tokens'
    blocks re-encoded (as tests/test_engine_kv_by_age.py configures it); ``settings``
    replace any of these."""
    settings = {"kv_cache_dtype": "int4", "kv_recent_tokens": 5} | settings
    config = EngineConfig(
        device=device,
        dtype="float32",
        block_size=16,
        kv_cache_memory="8MiB",
        max_num_seqs=8,
        max_num_batched_tokens=48,
        log_stats_interval=0,
        **settings,
    )
    return LLMEngine(config, loaded)


def triton_backend_for(kv_cache, sdpa_min_rows=None):
    """The Triton backend where the engine would build the CPU one."""
    return TritonAttentionBackend(kv_cache)


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


PROMPTS = [[(31 * i + 7 * s) % 480 + 3 for i in range(60 + 17 * s)] for s in range(3)]


@pytest.mark.parametrize("recent_dtype", ["auto", "int8"])
def test_int4_engine_on_triton_matches_the_cpu_backend(tiny_model, monkeypatch, recent_dtype):
    """Greedy tokens through the Triton kernels equal the C++ kernel's: prompts prefilled
    in chunks over their own re-encoded blocks, then decoding over mixed tables (with
    an int8 window, its keys stored rotated like the compact ones)."""
    prompts = PROMPTS
    cpu_engine = int4_engine(tiny_model, "cpu", kv_recent_dtype=recent_dtype)
    assert cpu_engine.runner.attn.uses_fast_kernel  # the C++ kernel over both kinds
    expected_tokens = greedy_tokens(cpu_engine, prompts)
    monkeypatch.setattr(model_worker, "attention_backend_for", triton_backend_for)
    loaded = load_model(str(tiny_model.source), device=TRITON_DEVICE)
    engine = int4_engine(loaded, TRITON_DEVICE, kv_recent_dtype=recent_dtype)
    assert isinstance(engine.runner.attn, TritonAttentionBackend)
    encoded = []
    encode = engine.kv_cache.encode_blocks

    def counted(pairs):
        encoded.extend(pairs)
        encode(pairs)

    monkeypatch.setattr(engine.kv_cache, "encode_blocks", counted)
    assert greedy_tokens(engine, prompts) == expected_tokens
    # at least the blocks wholly behind each prompt's last 5 tokens were re-encoded
    assert len(encoded) >= sum((len(p) - 5) // 16 for p in prompts)


def test_int8_engine_on_triton_matches_the_cpu_backend(tiny_model, monkeypatch):
    """An int8 cache (keys stored rotated, queries rotated alike) gives the same greedy
    tokens through the Triton kernels as through the C++ kernel."""
    int8 = {"kv_cache_dtype": "int8", "kv_recent_tokens": EngineConfig.kv_recent_tokens}
    cpu_engine = int4_engine(tiny_model, "cpu", **int8)
    assert cpu_engine.kv_cache.key_rotation is not None
    expected_tokens = greedy_tokens(cpu_engine, PROMPTS)
    monkeypatch.setattr(model_worker, "attention_backend_for", triton_backend_for)
    loaded = load_model(str(tiny_model.source), device=TRITON_DEVICE)
    engine = int4_engine(loaded, TRITON_DEVICE, **int8)
    assert isinstance(engine.runner.attn, TritonAttentionBackend)
    assert greedy_tokens(engine, PROMPTS) == expected_tokens
