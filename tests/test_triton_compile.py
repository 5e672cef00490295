"""Every Triton kernel launch the attention backend makes compiles for an Ampere GPU
(sm_80, the A100) and a Hopper GPU (sm_90, the H100 / H200), on a machine without one.

Triton's interpreter, which runs the kernels in the other tests when there is no GPU,
accepts code its compiler refuses (a plain Python global in a kernel, for one), so those
tests pass while the GPU path fails. Here the backend's wrappers run on CPU tensors with
each kernel replaced by a recorder of its launch; a fresh process without the interpreter
then compiles every recorded launch ahead of time (Triton's compiler and ``ptxas`` ship
in its wheel; no GPU or driver is involved) and reports each failure with its error.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from pagedllm.gpu import triton_decode, triton_kv_write, triton_prefill  # noqa: E402
from pagedllm.kv_storage.kv_cache import KVCache  # noqa: E402

pytestmark = pytest.mark.triton

KERNELS = {
    triton_decode: ("_decode_split_kernel", "_decode_merge_kernel"),
    triton_prefill: ("_prefill_kernel",),
    triton_kv_write: ("_kv_write_kernel",),
}

COMPILE = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import pagedllm.gpu.triton_decode, pagedllm.gpu.triton_prefill, pagedllm.gpu.triton_kv_write

def value(described):
    if isinstance(described, dict) and "tl_dtype" in described:
        return tl.dtype(described["tl_dtype"])
    if isinstance(described, dict):
        return described["value"]
    return described

failures = []
arch = int(sys.argv[1])
launches = json.load(sys.stdin)
for launch in launches:
    kernel = getattr(sys.modules[launch["module"]], launch["kernel"])
    signature, constexprs = {}, {}
    for param in kernel.params:
        described = launch["values"].get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value(described)
        else:
            signature[param.name] = described["type"]
    try:
        triton.compile(ASTSource(kernel, signature, constexprs),
                       target=GPUTarget("cuda", arch, 32), options=launch["options"])
    except Exception as error:
        failures.append(f"{launch['kernel']} {constexprs}: {str(error)[-600:]}")
print(json.dumps({"compiled": len(launches) - len(failures), "failures": failures}))
"""


def describe(value: object) -> object:
    """A launch argument as the compiling process reads it: a pointer or scalar's type
    (Triton's own name for it) with a scalar's value, or a constexpr's value."""
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, torch.Tensor):
        return {"type": mangle_type(value)}
    return {"type": mangle_type(value), "value": value}


class LaunchRecorder:
    """Stands in for a jit kernel: ``kernel[grid](*args, **kwargs)`` records the launch
    (argument descriptions by parameter name, and the compile options) and runs nothing."""

    def __init__(self, module, name: str, kernel, launches: list[dict]) -> None:
        self.module, self.name, self.kernel, self.launches = module, name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            names = list(inspect.signature(self.kernel.fn).parameters)
            values = dict(zip(names, args, strict=False)) | kwargs
            self.launches.append({
                "module": self.module.__name__, "kernel": self.name, "options": options,
                "values": {name: describe(value) for name, value in values.items()},
            })  # fmt: skip

        return launch


def launches_of_every_format(monkeypatch) -> list[dict]:
    """The backend's launches for every cache format and query dtype, with and without a
    sliding window and a soft-cap, at head sizes 64 and 128."""
    launches: list[dict] = []
    for module, names in KERNELS.items():
        for name in names:
            recorder = LaunchRecorder(module, name, getattr(module, name), launches)
            monkeypatch.setattr(module, name, recorder)
    cases = [("auto", torch.float32), ("auto", torch.bfloat16), ("auto", torch.float16),
             ("int8", torch.bfloat16), ("fp8_e4m3", torch.bfloat16),
             ("fp8_e5m2", torch.float32)]  # fmt: skip
    for (kv_cache_dtype, dtype), head_dim in zip(cases, [64, 128] * 3, strict=True):
        cache = KVCache(1, 8, 16, 2, head_dim, dtype, torch.device("cpu"), kv_cache_dtype)
        keys, values = cache.tensor[0, 0], cache.tensor[0, 1]
        k = torch.zeros(3, 2, head_dim, dtype=dtype)
        triton_kv_write.write_kv(k, k, keys, values, torch.arange(3), cache.format)
        q = torch.zeros(3, 8, head_dim, dtype=dtype)
        tables = torch.zeros(3, 4, dtype=torch.int32)
        seq_lens = torch.full((3,), 40, dtype=torch.int32)
        starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        for window, softcap in [(None, None), (16, 30.0)]:
            options = dict(sliding_window=window, logit_softcap=softcap)
            triton_decode.decode_attention(q, keys, values, tables, seq_lens, 40, 0.1,
                                           cache.format, **options)  # fmt: skip
            triton_prefill.prefill_attention(q, keys, values, tables, seq_lens, starts, 1,
                                             0.1, cache.format, **options)  # fmt: skip
    unique = {json.dumps(launch, sort_keys=True): launch for launch in launches}
    return list(unique.values())


@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_compiles(monkeypatch, arch):
    launches = launches_of_every_format(monkeypatch)
    assert {launch["kernel"] for launch in launches} == {n for ns in KERNELS.values() for n in ns}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(arch)], input=json.dumps(launches), env=env,
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["failures"] == []
    assert result["compiled"] == len(launches) >= 30
