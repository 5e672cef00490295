"""Leaving the process group stops gloo's threads, whatever was imported meanwhile.

Threads outliving ``destroy_process_group`` can release a finished collective's tensors
while the interpreter exits, which aborts the process ("terminate called without an
active exception"): seen at the end of two-node runs under load.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagedllm.server.launcher import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    import torch.distributed as dist

    from pagedllm.distributed.group import TensorParallelGroup, join_default_group

    def gloo_threads():
        names = (open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task"))
        return sorted(name for name in names if "gloo" in name)

    join_default_group(sys.argv[1], rank=0, world_size=1, timeout_s=30.0)
    import torch.distributed.fsdp  # what transformers imports while a model loads

    TensorParallelGroup(0, 1).broadcast_object("step")
    assert gloo_threads(), "the group runs no gloo threads: this test checks nothing"
    dist.destroy_process_group()
    print(gloo_threads())
    """
)


def test_gloo_threads_end_with_the_group():
    address = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, address], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
