"""Throughput of the engine on the synthetic workload; see ``pagedllm bench --help``.

Example (all comparisons of the engine issue in one run):
    python benchmarks/throughput.py --baseline --contiguous --dtypes float32,bfloat16
"""

import sys

from pagedllm.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
