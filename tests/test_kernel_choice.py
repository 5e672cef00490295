"""Kernel choice for the matrix products (pagedllm.cpu.kernel_choice): the winner of a
timing table, the timings cached per machine and read back, the forced kernels and their
validation, and the decoder's logits and greedy tokens through each kernel's weights
against transformers float32."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers_oracle import (
    LOGITS_TOLERANCE,
    PROMPTS,
    engine_greedy,
    our_logits,
    reference_greedy,
    reference_logits,
    write_random_checkpoint,
)

from pagedllm import EngineConfig, user_cache
from pagedllm.config_flags import add_config_flags, config_from_flags
from pagedllm.cpu import kernel_choice
from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.cpu.kernel_choice import BUCKETS, KernelChoice, TimingTable, shape_entry, winner
from pagedllm.cpu.onednn import reorderable
from pagedllm.models.linear import OneDNNWeight, PackedWeight, prepare_weight
from pagedllm.models.loader import load_model

# Read at collection, before conftest swaps in its fake timer and session cache folder
# (it also turns the contention check off: the tests below see every timing trusted).
REAL_TIMER, REAL_CACHE_DIR = kernel_choice.time_kernels, user_cache.cache_dir
REAL_CONTENDED = kernel_choice.contended
needs_avx512 = pytest.mark.skipif(
    not avx512_kernels_available(), reason="the packed kernel needs AVX-512"
)


def onednn_form(dtype: torch.dtype) -> type:
    """What oneDNN runs a weight of ``dtype`` in here: its blocked layout where it takes
    the dtype, else the plain matrix."""
    return OneDNNWeight if reorderable(torch.empty(1, 1, dtype=dtype)) else torch.Tensor


def flat(seconds: float) -> dict[int, float]:
    return dict.fromkeys(BUCKETS, seconds)


@pytest.fixture
def fake_timer(monkeypatch, tmp_path):
    """Installs a :class:`FakeTimer` with its own cache folder, so its made-up timings
    never reach other tests."""

    def install(
        onednn_shapes: set[tuple[int, int]] = frozenset(),
        dense_shapes: set[tuple[int, int]] = frozenset(),
    ) -> FakeTimer:
        timer = FakeTimer(onednn_shapes, dense_shapes)
        monkeypatch.setattr(kernel_choice, "time_kernels", timer)
        monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path / "pagedllm")
        return timer

    return install


class FakeTimer:
    """Timings in which onednn is faster for the shapes ``(out, in)`` of
    ``onednn_shapes`` (then dense second), dense for ``dense_shapes`` and packed for the
    others; records the shapes it timed and the candidates of each."""

    def __init__(
        self,
        onednn_shapes: set[tuple[int, int]] = frozenset(),
        dense_shapes: set[tuple[int, int]] = frozenset(),
    ) -> None:
        self.onednn_shapes, self.dense_shapes = onednn_shapes, dense_shapes
        self.timed: list[tuple[int, int]] = []
        self.candidates: list[tuple[str, ...]] = []

    def __call__(self, weight, kernels):
        shape = tuple(weight.shape)
        self.timed.append(shape)
        self.candidates.append(tuple(kernels))
        order = ["packed", "onednn", "dense"]
        if shape in self.onednn_shapes:
            order = ["onednn", "dense", "packed"]
        elif shape in self.dense_shapes:
            order = ["dense", "onednn", "packed"]
        return {k: flat(1e-3 * (1 + order.index(k))) for k in kernels}


def test_winner_is_the_least_weighted_score_with_a_margin_for_the_first():
    decode_fast = {1: 1e-5, 16: 5e-5, 128: 4e-4, 512: 2e-3}  # score 3.16 ms
    prefill_fast = {1: 5e-5, 16: 1e-4, 128: 3e-4, 512: 1.1e-3}  # score 2.9 ms
    assert winner({"packed": decode_fast, "onednn": prefill_fast}) == "packed"  # < 10% off
    assert winner({"onednn": prefill_fast, "packed": decode_fast}) == "onednn"
    prefill_much_faster = {**prefill_fast, 512: 2e-4}  # score 2.0 ms
    assert winner({"packed": decode_fast, "onednn": prefill_much_faster}) == "onednn"
    assert winner({"onednn": flat(1.0)}) == "onednn"


@needs_avx512
def test_auto_keeps_each_shape_in_its_winners_form_timing_each_shape_once(fake_timer):
    timer = fake_timer(onednn_shapes={(96, 64)})
    choice = KernelChoice("auto")
    fp32_form, bf16_form = onednn_form(torch.float32), onednn_form(torch.bfloat16)
    assert isinstance(prepare_weight(torch.randn(96, 64), choice), fp32_form)
    assert isinstance(prepare_weight(torch.randn(96, 64), choice), fp32_form)
    assert isinstance(prepare_weight(torch.randn(48, 64), choice), PackedWeight)
    # bfloat16 is another table row; float16 has one candidate and is never timed
    assert isinstance(prepare_weight(torch.randn(96, 64).bfloat16(), choice), bf16_form)
    assert type(prepare_weight(torch.randn(96, 64).half(), choice)) is torch.Tensor
    assert timer.timed == [(96, 64), (48, 64), (96, 64)]
    summary = choice.summary()
    assert summary.startswith("Matrix kernels (timed on ")
    assert summary.endswith("onednn for 2 shapes, packed for 1 shape, dense for 1 shape")


@needs_avx512
def test_dense_can_win_and_a_tied_weight_never_takes_onednns_layout(fake_timer):
    timer = fake_timer(onednn_shapes={(96, 64)}, dense_shapes={(80, 64)})
    choice = KernelChoice("auto")
    assert type(prepare_weight(torch.randn(80, 64), choice)) is torch.Tensor
    # rows also read (a tied LM head): oneDNN's opaque layout is no candidate
    tied = prepare_weight(torch.randn(96, 64).bfloat16(), choice, rows_read=True)
    assert type(tied) is torch.Tensor
    assert timer.candidates[-1] == ("packed", "dense")
    assert type(prepare_weight(torch.randn(96, 64), KernelChoice("onednn"), True)) is torch.Tensor


def test_timings_are_cached_per_machine_and_read_back(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(user_cache, "cache_dir", REAL_CACHE_DIR)
    timed = []

    def counted(weight, kernels):
        timed.append(tuple(weight.shape))
        return REAL_TIMER(weight, kernels)

    monkeypatch.setattr(kernel_choice, "time_kernels", counted)
    kernels = ("packed",) * avx512_kernels_available() + ("onednn", "dense")
    weight = torch.randn(100, 64)
    first = TimingTable()
    measured = first.timings(shape_entry(weight), kernels, lambda: counted(weight, kernels))
    assert first.path.parent == tmp_path / "pagedllm" and first.entries_timed == 1
    assert all(set(measured[k]) == set(BUCKETS) and min(measured[k].values()) > 0 for k in kernels)
    stored = json.loads(first.path.read_text())
    assert stored["key"] == kernel_choice.machine_key()
    assert stored["key"]["threads"] == torch.get_num_threads()
    again = TimingTable()
    again_timed = again.timings(shape_entry(weight), kernels, lambda: counted(weight, kernels))
    assert again_timed == measured and again.entries_timed == 0
    assert timed == [(100, 64)]
    other_torch = {**kernel_choice.machine_key(), "torch": "0.0"}
    assert kernel_choice.cache_path(other_torch) != first.path
    assert TimingTable(other_torch).entries == {}


@needs_avx512
def test_timings_under_contention_keep_the_preferred_kernel_uncached(
    fake_timer, monkeypatch, caplog
):
    timer = fake_timer(onednn_shapes={(96, 64)})
    monkeypatch.setattr(kernel_choice, "contended", lambda cores: True)
    choice = KernelChoice("auto")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        for _ in range(3):  # the layers of a model: timed once
            assert isinstance(prepare_weight(torch.randn(96, 64), choice), PackedWeight)
        assert isinstance(prepare_weight(torch.randn(48, 64), choice), PackedWeight)
    assert timer.timed == [(96, 64), (48, 64)]
    assert caplog.text.count("cores busy while the matrix kernels were timed") == 1
    assert not choice.table.path.exists()  # the next start times them again
    assert "timed 2 shapes in" in choice.summary()
    assert "2 under contention (preferred kernel)" in choice.summary()


def test_contention_counts_the_cores_torch_threads_need(monkeypatch):
    monkeypatch.setattr(kernel_choice.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(kernel_choice.torch, "get_num_threads", lambda: 6)
    assert not REAL_CONTENDED(2.4)  # two cores spare, plus the margin
    assert REAL_CONTENDED(2.6)
    # 2 s of wall time, 9 CPU seconds busy of which 4 ours: others kept 2.5 cores busy
    assert kernel_choice.other_cores((10.0, 100.0, 1.0), (12.0, 109.0, 5.0)) == 2.5


def test_a_cache_that_cannot_be_written_only_warns(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(user_cache, "cache_dir", lambda: blocker / "pagedllm")
    table = TimingTable()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        table.timings("float32 8x8", ("onednn",), lambda: REAL_TIMER(torch.randn(8, 8), ["onednn"]))
    assert "Cannot cache matrix kernel timings" in caplog.text
    assert set(table.entries) == {"float32 8x8"}


@needs_avx512
@pytest.mark.parametrize("forced", ["packed", "onednn", "dense"])
def test_a_forced_kernel_is_never_timed(fake_timer, forced):
    timer = fake_timer()
    choice = KernelChoice(forced)
    for dtype in (torch.float32, torch.bfloat16):
        form = {"packed": PackedWeight, "onednn": onednn_form(dtype), "dense": torch.Tensor}
        assert type(prepare_weight(torch.randn(96, 64, dtype=dtype), choice)) is form[forced]
    assert timer.timed == []
    if forced != "onednn" or onednn_form(torch.bfloat16) is OneDNNWeight:
        expected = f"{forced} for 2 shapes"
        assert choice.summary() == f"Matrix kernels (linear_kernel={forced}): {expected}"


def test_packed_where_it_cannot_run_is_refused():
    with pytest.raises(ValueError, match="cannot run a torch.float16 weight"):
        prepare_weight(torch.randn(8, 8).half(), KernelChoice("packed"))
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, packed, onednn"):
        KernelChoice("mkl")


def test_engine_config_validates_linear_kernel(monkeypatch):
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        EngineConfig(linear_kernel="fastest")
    with pytest.raises(ValueError, match="takes float32 or bfloat16 weights, not torch.float16"):
        EngineConfig(device="cpu", dtype="float16", linear_kernel="packed")
    monkeypatch.setattr("pagedllm.config.avx512_kernels_available", lambda: False)
    with pytest.raises(ValueError, match="needs the C\\+\\+ AVX-512 kernels"):
        EngineConfig(device="cpu", linear_kernel="packed")
    assert EngineConfig(device="cpu", linear_kernel="onednn").linear_kernel == "onednn"


def test_linear_kernel_is_a_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--device", "cpu", "--linear-kernel", "onednn"])
    assert config_from_flags(args).linear_kernel == "onednn"
    with pytest.raises(SystemExit):
        parser.parse_args(["--linear-kernel", "blas"])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random transformers Llama checkpoint and its float32 eager model."""
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_random_checkpoint(folder, "llama")


def matrices(model) -> list:
    layer = model.layers[0]
    return [layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight,
            model.lm_head]  # fmt: skip


KERNELS = ["packed"] * avx512_kernels_available() + ["onednn", "dense"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_matches_transformers(tiny_llama, kernel, caplog):
    folder, reference = tiny_llama
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        model = load_model(folder, linear_kernel=kernel).model
    form = {"packed": PackedWeight, "onednn": onednn_form(torch.float32), "dense": torch.Tensor}
    tied = model.lm_head is model.embed_tokens
    assert all(type(w) is form[kernel] for w in matrices(model)[:-1])
    assert type(model.lm_head) is (torch.Tensor if tied and kernel == "onednn" else form[kernel])
    assert caplog.text.count("Matrix kernels") == 1
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(
        our_logits(model, tokens), reference_logits(reference, tokens),
        atol=LOGITS_TOLERANCE, rtol=0,
    )  # fmt: skip
    expected = [reference_greedy(reference, p) for p in PROMPTS]
    assert engine_greedy(folder, linear_kernel=kernel) == expected


@needs_avx512
def test_auto_reaches_the_decoder_by_measurement(tiny_llama, fake_timer):
    folder, reference = tiny_llama
    fake_timer(onednn_shapes={(64, 64)})
    model = load_model(folder).model  # o_proj [64, 64] by onednn, the rest packed
    assert [type(w) for w in matrices(model)] == [
        PackedWeight, onednn_form(torch.float32), *[PackedWeight] * 3
    ]  # fmt: skip
    tokens = list(range(3, 43))
    torch.testing.assert_close(
        our_logits(model, tokens), reference_logits(reference, tokens),
        atol=LOGITS_TOLERANCE, rtol=0,
    )  # fmt: skip
