"""Without a C++ compiler the engine still serves: one warning, torch's operators, the
same greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tiny_checkpoints import run_token_ids, tiny_engine

from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models.loader import load_model

PROMPTS = [list(range(100, 140)), [5, 6, 7]]
PARAMS = dict(temperature=0.0, max_tokens=8, ignore_eos=True)

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[2])
from tiny_checkpoints import run_token_ids, tiny_engine
from pagedllm.cpu.extension import kernels_built
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models.loader import load_model
engine = tiny_engine(load_model(sys.argv[1]), 64)
tokens = run_token_ids(engine, json.loads(sys.argv[3]), SamplingParams(**json.loads(sys.argv[4])))
print(json.dumps({"kernels_built": kernels_built(), "tokens": tokens}))
"""


def test_engine_runs_on_torch_operators_when_the_kernels_cannot_be_built(tmp_path):
    folder = write_tiny_llama(tmp_path / "model")
    expected = run_token_ids(
        tiny_engine(load_model(str(folder)), 64), PROMPTS, SamplingParams(**PARAMS)
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
    }
    tests_dir = os.path.dirname(__file__)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), tests_dir, json.dumps(PROMPTS),
         json.dumps(PARAMS)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kernels_built"] is False
    assert "could not be built" in done.stderr
    assert done.stderr.count("could not be built") == 1
    assert result["tokens"] == expected
