"""The server with speculative decoding: started with ``--speculative-config``, it
answers the openai SDK with the tokens an engine without guesses gives, publishes
vLLM's speculative decoding metrics, serves a draft model, and refuses at start a draft
model that is not there."""

from __future__ import annotations

import json

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import LLM, SamplingParams
from pagedllm.server.launcher import ServerProcess

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "adaptive_draft_length": False,
}
SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--log-stats-interval", "0"]
PROMPT = "one two three four five one two three four five one two three four five one two"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-spec"))


@pytest.fixture(scope="module")
def server(model_folder):
    args = ["--model", str(model_folder), *SERVE_ARGS, "--speculative-config", json.dumps(SPEC)]
    with ServerProcess(args) as process:
        yield process


def test_completions_equal_decoding_without_guesses(client, server, model_name, model_folder):
    reply = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=40, temperature=0.0, logprobs=2
    )
    llm = LLM(model=str(model_folder), dtype="float32", kv_cache_memory="16MiB")
    plain = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    assert reply.choices[0].text == plain[0].outputs[0].text
    assert len(reply.choices[0].logprobs.tokens) == len(plain[0].outputs[0].token_ids)
    metrics = process_metrics(server)
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0
    assert (
        metrics["vllm:spec_decode_num_draft_tokens_total"]
        >= metrics["vllm:spec_decode_num_accepted_tokens_total"]
    )
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics


def test_a_draft_model_that_is_not_there_stops_the_server_at_start(model_folder):
    config = {"method": "draft_model", "model": "x", "num_speculative_tokens": 2}
    args = ["--model", str(model_folder), *SERVE_ARGS, "--speculative-config", json.dumps(config)]
    with pytest.raises(RuntimeError, match="neither a .gguf file nor a folder"):
        ServerProcess(args, startup_timeout_s=120).start()


def test_streamed_chat_with_a_stop_string_equals_decoding_without_guesses(
    client, model_name, model_folder
):
    """Several tokens may arrive in one step: the stream's pieces add up to the text
    plain decoding gives, cut at the same stop string."""
    messages = [{"role": "user", "content": PROMPT}]
    llm = LLM(model=str(model_folder), dtype="float32", kv_cache_memory="16MiB")
    whole = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    text = whole[0].outputs[0].text
    assert len(text) > 20
    for stop in (None, [text[len(text) // 2 : len(text) // 2 + 3]]):  # a stop met midway
        stream = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=40, temperature=0.0, stream=True,
            stop=stop,
        )  # fmt: skip
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        params = SamplingParams(temperature=0.0, max_tokens=40, stop=stop or [])
        plain = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        assert "".join(pieces) == plain.text
        assert (plain.finish_reason == "stop") == (stop is not None)


def test_a_draft_model_serves_the_targets_greedy_text(model_folder):
    """``draft_model`` through the server and the openai SDK: the target's checkpoint
    drafting for itself in bfloat16; the chat answer is plain decoding's, and drafts
    were verified."""
    import openai

    config = {"method": "draft_model", "model": str(model_folder), "dtype": "bfloat16",
              "num_speculative_tokens": 3, "adaptive_draft_length": False}  # fmt: skip
    args = ["--model", str(model_folder), *SERVE_ARGS, "--speculative-config", json.dumps(config)]
    messages = [{"role": "user", "content": PROMPT}]
    llm = LLM(model=str(model_folder), dtype="float32", kv_cache_memory="16MiB")
    plain = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    with ServerProcess(args, startup_timeout_s=120) as process:
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=model_folder.name, messages=messages, max_tokens=30, temperature=0.0
        )
        metrics = process_metrics(process)
    assert reply.choices[0].message.content == plain[0].outputs[0].text
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0


def process_metrics(process: ServerProcess) -> dict[str, float]:
    """The server's ``vllm:spec_decode*`` metrics by name (labels dropped)."""
    import httpx

    text = httpx.get(f"{process.base_url}/metrics").text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:spec_decode") and "_created" not in line
    }
