"""Triton kernels for the CUDA backend: the K/V write at ``slot_mapping``, paged decode
attention (split-K) and paged prefill attention, all reading K/V through the block table.

They run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this package is imported), which is how the tests
check them on machines without a GPU.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from pagedllm.gpu.interpreter_compat import patch_interpreter

    patch_interpreter()
