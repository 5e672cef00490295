"""``pagedllm serve`` under load on a KV pool far too small for its clients:
64 concurrent streams complete with the outputs each gets alone, preemptions show
in ``/metrics``, every block comes back; 20 clients that leave mid-stream have
their requests aborted and their blocks freed, and the server keeps serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
BLOCK_BYTES = 2 * 30 * BLOCK_SIZE * 3 * 64 * 4
"""One block of the default model in float32: K and V, 30 layers, 3 KV heads x 64."""
NUM_BLOCKS = 24
"""About six sequences of the longest request here (47 prompt + 15 output tokens)."""
SERVE_ARGS = [
    "--dtype", "float32",
    "--kv-cache-memory", str(NUM_BLOCKS * BLOCK_BYTES),
    "--block-size", str(BLOCK_SIZE),
    "--max-model-len", "160",
    "--log-stats-interval", "0",
]  # fmt: skip
PHRASE = (
    "the paged cache keeps every sequence in small fixed blocks so that memory is "
    "shared and nothing is reserved before it is needed while many clients wait"
)
WORDS = PHRASE.split()
DISTINCT = [(" ".join((WORDS * 2)[: 3 + 6 * i]), 8 + i) for i in range(8)]
"""(prompt, max_tokens): prompts of 3 to 45 words (4 to 47 tokens), 8 to 15 output tokens;
each is sent by eight of the concurrent clients."""
NUM_CLIENTS = 64


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVE_ARGS) as process:
        yield process


def metrics(server) -> dict[str, float]:
    """Every sample of ``/metrics`` by name (labels dropped; one model, one series)."""
    text = httpx.get(f"{server.base_url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.get("finished_reason")
    }


def wait_until_idle(server, timeout_s: float = 60.0) -> dict[str, float]:
    """Metrics once nothing runs, waits or holds a block (the loop applies aborts
    between steps, so this may take a step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(server)
        idle = (
            values["vllm:num_requests_running"] == 0
            and values["vllm:num_requests_waiting"] == 0
            and values["pagedllm:kv_blocks_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


async def stream_text(client, prompt: str, max_tokens: int) -> tuple[str, str]:
    """The streamed text and finish reason of one greedy completion."""
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_64_concurrent_streams_under_preemption(server):
    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600
        )
        alone = [await stream_text(client, p, m) for p, m in DISTINCT]
        before = metrics(server)["vllm:num_preemptions_total"]
        jobs = [DISTINCT[i % len(DISTINCT)] for i in range(NUM_CLIENTS)]
        together = await asyncio.gather(*(stream_text(client, p, m) for p, m in jobs))
        await client.close()
        return alone, before, together

    alone, preemptions_before, together = asyncio.run(run())
    for index, result in enumerate(together):
        assert result == alone[index % len(DISTINCT)], index
        assert result[1] in ("stop", "length")
    values = wait_until_idle(server)
    assert values["pagedllm:kv_blocks_total"] == NUM_BLOCKS
    assert values["vllm:num_preemptions_total"] > preemptions_before
    assert values["vllm:prefix_cache_hits_total"] > 0  # each prompt comes nine times
    assert values["pagedllm:kv_blocks_used"] == 0
    assert values["pagedllm:kv_blocks_free"] == NUM_BLOCKS
    assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0


def test_clients_that_leave_mid_stream_are_aborted(server):
    num_leaving = 20
    aborted_before = metrics(server)["pagedllm:num_requests_aborted_total"]

    async def leave_after_two_chunks(http: httpx.AsyncClient) -> int:
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 120, "stream": True}
        body["ignore_eos"] = True
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def run():
        limits = httpx.Limits(max_connections=num_leaving)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(leave_after_two_chunks(http) for _ in range(num_leaving)))

    assert asyncio.run(run()) == [2] * num_leaving
    values = wait_until_idle(server)
    assert values["pagedllm:num_requests_aborted_total"] - aborted_before == num_leaving
    assert values["pagedllm:kv_blocks_used"] == 0
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
