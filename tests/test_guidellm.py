"""guidellm's default streaming benchmark (its real CLI, synthetic prompts) against a
live server: every request succeeds with the output length asked for, through chat and
text completions, one request at a time and several at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess

pytest.importorskip("guidellm")
pytestmark = pytest.mark.slow

NUM_REQUESTS = 12
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-guidellm"))


@pytest.fixture(scope="module")
def server(model_folder):
    args = ["--model", str(model_folder), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    args += ["--max-model-len", "512"]
    with ServerProcess([*args, "--log-stats-interval", "0"]) as process:
        yield process


@pytest.mark.parametrize(
    ("profile", "request_format"),
    [
        ("kind=synchronous", "/v1/chat/completions"),
        ("kind=concurrent,streams=4", "/v1/completions"),
    ],
)
def test_every_guidellm_request_succeeds(server, model_folder, tmp_path, profile, request_format):
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={server.base_url},request_format={request_format}",
        "--profile", profile,
        "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=hf_auto,model={model_folder}",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert len(requests["errored"]) == 0 and len(requests["incomplete"]) == 0
    assert len(requests["successful"]) == NUM_REQUESTS
    for request in requests["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] is True
        assert body["stream_options"]["continuous_usage_stats"] is True
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
