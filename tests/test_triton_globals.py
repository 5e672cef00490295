"""Every Triton kernel reads module globals only as Triton's compiler accepts them:
``tl.constexpr`` values, modules and other jit functions. The interpreter (what runs the
kernels without CUDA) reads any Python global, so a plain float there passes every CPU
test and fails to compile on the GPU."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

import pagedllm.gpu  # noqa: E402

pytestmark = pytest.mark.triton


def names_read(code: types.CodeType) -> set[str]:
    """Every global or attribute name ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= names_read(constant)
    return names


def jit_functions() -> list[tuple[str, types.FunctionType]]:
    """(qualified name, Python function) of every jit function defined in pagedllm.gpu."""
    found = []
    for info in pkgutil.iter_modules(pagedllm.gpu.__path__):
        module = importlib.import_module(f"pagedllm.gpu.{info.name}")
        for name, value in vars(module).items():
            function = getattr(value, "fn", None)
            if isinstance(function, types.FunctionType) and function.__module__ == module.__name__:
                found.append((f"{module.__name__}.{name}", function))
    return found


def is_compilable_global(value: object) -> bool:
    jit_types = (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction)
    return isinstance(value, (tl.constexpr, types.ModuleType, *jit_types))


def test_every_global_a_kernel_reads_is_constexpr_a_module_or_a_jit_function():
    functions = jit_functions()
    assert len(functions) >= 10  # the decode, prefill and K/V-write kernels and helpers
    offending = [
        f"{qualified} reads {name} ({type(function.__globals__[name]).__name__})"
        for qualified, function in functions
        for name in sorted(names_read(function.__code__))
        if name in function.__globals__ and not is_compilable_global(function.__globals__[name])
    ]
    assert offending == []
