"""The OpenAI API of ``pagedllm serve`` through the official client: chat and
completions, streamed and not, n > 1, seeds, stops, logprobs, batches, greedy
equality with the offline ``LLM`` API, models, health and metrics."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# The server's matrix kernels forced to the ones conftest gives the in-process engine.
KERNEL = "packed" if avx512_kernels_available() else "onednn"
SERVE_ARGS = ["--dtype", "float32", "--linear-kernel", KERNEL, "--kv-cache-memory", "64MiB"]
SERVE_ARGS += ["--max-model-len", "512", "--log-stats-interval", "0"]
CHAT_PROMPTS = ["What is the capital of France?", "Name three colours."]
TEXT_PROMPTS = ["The quick brown fox", "Once upon a time, there was"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVE_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def offline():
    """Greedy outputs of the offline API, one prompt at a time (as the server runs them)."""
    from pagedllm.engine.llm import LLM
    from pagedllm.engine.sampling_params import SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, log_stats_interval=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat = [
        llm.chat([{"role": "user", "content": p}], greedy, use_tqdm=False)[0].outputs[0].text
        for p in CHAT_PROMPTS
    ]
    text = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].text for p in TEXT_PROMPTS]
    return {"chat": chat, "text": text}


def chat_greedy(client, prompt: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        **kwargs,
    )


def test_models_and_health(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_chat_greedy_equals_offline_llm(client, offline):
    for prompt, expected in zip(CHAT_PROMPTS, offline["chat"], strict=True):
        reply = chat_greedy(client, prompt)
        choice = reply.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == expected
        assert reply.usage.completion_tokens <= MAX_TOKENS
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_greedy_equals_offline_llm(client, offline):
    for prompt, expected in zip(TEXT_PROMPTS, offline["text"], strict=True):
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert reply.choices[0].text == expected
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_whole_and_reports_usage(client, offline):
    stream = chat_greedy(
        client, CHAT_PROMPTS[0], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline["chat"][0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_streamed_completion_equals_whole(client, offline):
    stream = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == offline["text"][1]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n3_seeded_samples_are_distinct_and_reproducible(client):
    def sample():
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a word."}],
            max_tokens=8,
            temperature=1.0,
            n=3,
            seed=1234,
        )
        assert sorted(c.index for c in reply.choices) == [0, 1, 2]
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample()
    assert len(set(first)) == 3
    assert sample() == first


def test_n3_streamed_matches_whole(client):
    kwargs = dict(model=MODEL, prompt="Colours:", max_tokens=8, temperature=1.0, n=3, seed=7)
    whole = client.completions.create(**kwargs)
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]


def test_stop_string_cuts_the_reply(client, offline):
    full = offline["text"][0]
    stop = full.strip().split()[1]
    reply = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]


def test_logprobs_of_chat_and_completion(client):
    reply = chat_greedy(client, CHAT_PROMPTS[1], logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    reply = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=4, temperature=0.0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == reply.choices[0].text


def test_batch_and_token_id_prompts(client, offline):
    reply = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0, n=2
    )
    by_index = {c.index: c.text for c in reply.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1]
    assert by_index[2] == by_index[3]
    ids = [504, 2365, 6354, 16438]
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0.0)
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].text


def test_metrics_follow_the_engine(server, client):
    chat_greedy(client, CHAT_PROMPTS[0])
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "pagedllm:kv_blocks_used",
        "pagedllm:kv_blocks_free",
        "pagedllm:num_requests_preempted",
        "pagedllm:num_requests_aborted_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in text, name
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in text
