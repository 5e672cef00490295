"""A served prefix outlives its server: ``pagedllm serve --kv-cache-dir`` writes its cached
blocks at shutdown, and the next server over the directory restores them from disk
(the openai SDK's answers unchanged, the restore visible in ``/metrics``)."""

from __future__ import annotations

import sys

import httpx
import openai
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess

VERBOSE = [sys.executable, "-m", "pagedllm.cli", "--verbose"]  # the tiers' log lines
PROMPT = "the river rises in the northern hills and flows south " * 12


def metric(server: ServerProcess, name: str, labels: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels}")


def complete(server: ServerProcess) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    reply = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=12, temperature=0.0
    )
    return reply.choices[0].text


def test_a_restarted_server_restores_its_prefix_from_disk(tmp_path):
    model = write_tiny_chat_llama(tmp_path / "model")
    kv = str(tmp_path / "kv")
    args = ["--model", str(model), "--dtype", "float32", "--kv-cache-dir", kv]
    first = ServerProcess(args, entry=VERBOSE).start()
    try:
        answer = complete(first)
        assert metric(first, "pagedllm:kv_tier_hits_total", 'tier="disk"') == 0
    finally:
        assert first.stop() == 0  # SIGINT: a graceful shutdown
    assert "cached blocks written to disk at shutdown" in first.log()
    with ServerProcess(args, entry=VERBOSE) as second:
        assert "blocks (limit" in second.log() and " 0 of " not in second.log()
        assert complete(second) == answer
        assert metric(second, "pagedllm:kv_tier_hits_total", 'tier="disk"') > 0
        assert metric(second, "pagedllm:kv_tier_bytes_total", 'move="load"') > 0
        assert metric(second, "pagedllm:kv_tier_requests_waited_total", "") == 1
