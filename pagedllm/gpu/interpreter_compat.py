"""Lets Triton 3.6's interpreter take tensor loop bounds under NumPy >= 2.4.

The interpreter holds every scalar as a one-element array and converts it with
``int(array)``, which NumPy 2.4 refuses for arrays with a dimension (``TypeError: only
0-dimensional arrays can be converted to Python scalars``), so ``range(start, end)``
over loaded values fails. Triton's later releases convert the single element
explicitly (triton-lang/triton issue 9171); this does the same on the versions that do
not. Only used when ``TRITON_INTERPRET=1``; compiled kernels never run this code.
"""

from __future__ import annotations

import numpy as np


def _scalar_index(tensor) -> int:
    return int(np.asarray(tensor.handle.data).reshape(()))


def patch_interpreter() -> None:
    """Makes the interpreter's tensors convert to loop bounds (idempotent)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagedllm_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patch_lang_tensor._pagedllm_scalar_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
