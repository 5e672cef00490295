"""The dashboard's feeds against a live server on the default model: the pool
snapshot and its deltas (shared blocks for n > 1, evictable blocks after finishing,
figures equal to /metrics, a request's table, a disconnect freeing it), the
kv-events stream in vLLM's shape, the prefix-cache reset, the block lifetime
histograms and the API key. (A feed samples the pool at most 4 times a second, so the
requests here run long enough to be seen: the default model, not a tiny one.)"""

from __future__ import annotations

import httpx
import pytest
from feed_reader import FeedReader
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.server.launcher import ServerProcess

API_KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVE_ARGS = ["--kv-cache-memory", "48MiB", "--max-model-len", "1024"]
SERVE_ARGS += ["--log-stats-interval", "0", "--block-size", "16"]
SERVE_ARGS += ["--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0"]
SERVE_ARGS += ["--api-key", API_KEY, "--api-key-scope", "all"]
PROMPT = "The pool holds the cache in blocks of sixteen tokens, shared by reference. " * 6
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVE_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as client:
        yield client


def metric_values(http) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values


def complete(http, **fields):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_is_open_and_its_feeds_need_the_key(server):
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/events" in page.text and "http://" not in page.text.replace(
        "http://www.w3.org/2000/svg", ""
    )
    for path in ("/dashboard/events", "/kv_events"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401


def test_the_feed_shows_sharing_then_evictable_blocks_and_agrees_with_metrics(server, http):
    with FeedReader(f"{server.base_url}/dashboard/events", headers=AUTH) as feed:
        snapshot = feed.last("snapshot")
        num_blocks = snapshot["pool"]["num_blocks"]
        assert num_blocks == metric_values(http)["pagedllm:kv_blocks_total"]
        assert snapshot["pool"]["block_size"] == 16
        assert len(snapshot["reserved"]) == snapshot["pool"]["num_reserved"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "n": 4}
        body.update(stream=True, ignore_eos=True, temperature=1.0)
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            # while the 4 samples run, the prompt's full blocks are held by all 4
            feed.wait_for(lambda: feed.count("shared") > 0)
            assert max(ref for ref, _, _ in feed.blocks.values()) == 4
            for _ in response.iter_lines():
                pass
        feed.wait_for(lambda: feed.last() and feed.last()["stats"]["num_running"] == 0)
        feed.wait_for(lambda: feed.count("evictable") > 0 and feed.count("held") == 0)
        stats = feed.last()["stats"]
        metrics = metric_values(http)
        assert feed.count("evictable") == stats["num_blocks_evictable"]
        assert stats["num_blocks_evictable"] == metrics["pagedllm:kv_blocks_evictable"]
        assert stats["num_blocks_cached"] == metrics["pagedllm:kv_blocks_cached"]
        assert stats["num_blocks_used"] == metrics["pagedllm:kv_blocks_used"] == 0
        assert stats["block_table_hits"] == metrics["pagedllm:kv_block_table_hits_total"]
        assert 0 < stats["block_table_hits"] < stats["block_table_lookups"]
        assert stats["allocation_calls"] == metrics["pagedllm:kv_allocations_total"]
        assert feed.last()["requests"] == []


def test_a_request_appears_with_its_block_table_while_it_runs(server, http):
    with FeedReader(f"{server.base_url}/dashboard/events", headers=AUTH) as feed:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "stream": True}
        body["ignore_eos"] = True
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))

            def listed():
                message = feed.last()
                return message and message["requests"]

            (entry,) = feed.wait_for(listed)
            assert entry["status"] == "running" and entry["request_id"].startswith("cmpl-")
            table = entry["block_table"]
            # the table holds every computed token's slot; a token just sampled gets
            # its slot when it is next scheduled
            computed, total = entry["num_computed_tokens"], entry["num_tokens"]
            assert -(-computed // 16) <= len(table) <= -(-total // 16)
            assert computed < total
            assert all(feed.blocks[block_id][0] >= 1 for block_id in table)
        # the client left mid-stream: the request is aborted and its blocks freed
        feed.wait_for(lambda: feed.last()["requests"] == [] and feed.count("held") == 0)
        assert all(feed.blocks.get(block_id, [0])[0] == 0 for block_id in table)


def test_kv_events_follow_the_prefix_cache_in_vllms_shape(server, http):
    complete(http)  # something cached before the reader connects
    with FeedReader(f"{server.base_url}/kv_events", sse=False, headers=AUTH) as reader:
        (_, first, _), *_ = reader.messages
        stored = {e["block_hashes"][0]: e for e in first["events"]}
        assert stored and all(e["type"] == "BlockStored" for e in stored.values())
        for event in stored.values():  # parents come first
            parent = event["parent_block_hash"]
            assert parent is None or list(stored).index(parent) < list(stored).index(
                event["block_hashes"][0]
            )
            assert event["block_size"] == 16 and len(event["token_ids"]) == 16
            assert event["medium"] == "CPU"
        complete(http, prompt="Another prompt entirely, long enough to fill a block. " * 4)
        reader.wait_for(lambda: len(reader.messages) > 1)
        assert http.post("/reset_prefix_cache").json() == {"reset": True}
        reader.wait_for(
            lambda: reader.messages[-1][1]["events"][-1] == {"type": "AllBlocksCleared"}
        )
        assert metric_values(http)["pagedllm:kv_blocks_cached"] == 0


def test_block_lifetimes_are_observed_when_blocks_are_evicted(server, http):
    before = metric_values(http).get("vllm:kv_block_lifetime_seconds_count", 0.0)
    # fill the pool with new prompts until cached blocks are evicted
    num_blocks = metric_values(http)["pagedllm:kv_blocks_total"]
    for index in range(int(num_blocks // 6) + 2):  # prompts of 6 full blocks
        complete(http, prompt=f"{index} apples and pears, " * 16, max_tokens=1)
    metrics = metric_values(http)
    assert metrics["vllm:kv_block_lifetime_seconds_count"] > before
    assert metrics["vllm:kv_block_idle_before_evict_seconds_count"] > before


def test_swapping_shows_in_the_feed_and_by_mode_in_metrics(tmp_path):
    """A pool too small for the load preempts by swapping: the feed carries the swap
    space and counts the swaps as /metrics does (by mode)."""
    import threading

    from tiny_chat_model import write_tiny_chat_llama

    folder = write_tiny_chat_llama(tmp_path / "tiny-chat")
    args = ["--model", str(folder), "--dtype", "float32", "--block-size", "4"]
    args += ["--kv-cache-memory", "320KiB", "--swap-space", "1MiB"]
    args += ["--preemption-mode", "swap", "--max-model-len", "256", "--log-stats-interval", "0"]
    with ServerProcess(args) as server, FeedReader(f"{server.base_url}/dashboard/events") as feed:
        swap = feed.last("snapshot")["swap"]
        assert swap is not None and swap["num_blocks"] > 0 and swap["used"] == []

        def run(index):
            body = {"model": folder.name, "prompt": f"{index} " * 20, "max_tokens": 120}
            body["ignore_eos"] = True
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        feed.wait_for(lambda: feed.last()["stats"]["num_running"] == 0)
        feed.wait_for(lambda: feed.last()["stats"]["preemptions_swap"] > 0)
        stats = feed.last()["stats"]
        text = httpx.get(f"{server.base_url}/metrics").text
        swaps = next(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "pagedllm:num_preemptions_by_mode_total"
            and sample.labels["mode"] == "swap"
        )
        assert stats["preemptions_swap"] == swaps > 0
        assert feed.last()["swap"]["used"] == []
