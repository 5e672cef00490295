"""Data-parallel replicas behind the router, on this machine: ``pagedllm serve
--data-parallel-size 3`` with a tiny model, driven through the openai client. Greedy
outputs equal a single engine's; a repeated prompt goes back to the replica that cached
it; streams and usage pass through; a replica killed with SIGKILL mid-run loses only
the streams it was sending (their clients get an error event), every other request is
answered (re-sent), and the restarted replica is taken back."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")

ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "512"]
ENGINE_ARGS += ["--block-size", "4", "--log-stats-interval", "0"]
REPLICAS = 3
PROMPTS = [f"Tell me about paging, part {index}." for index in range(6)]
SYSTEM = "You answer questions about memory management with care and detail. " * 3


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def router(model_folder):
    args = ["--model", str(model_folder), *ENGINE_ARGS, "--data-parallel-size", str(REPLICAS)]
    with ServerProcess(args) as process:
        wait_until(lambda: healthy_replicas(process) == REPLICAS)
        yield process


def router_metrics(server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, sample.labels.get("replica", ""))] = sample.value
    return values


def healthy_replicas(server) -> int:
    metrics = router_metrics(server)
    return int(sum(v for (name, _), v in metrics.items() if name.endswith("replica_healthy")))


def wait_until(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError("timed out")


def requests_by_replica(server) -> list[float]:
    metrics = router_metrics(server)
    return [metrics.get(("pagedllm_router:requests_total", str(i)), 0.0) for i in range(REPLICAS)]


def client_of(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_greedy_outputs_equal_a_single_engines(router, model_folder):
    with ServerProcess(["--model", str(model_folder), *ENGINE_ARGS]) as single:
        expected = [
            client_of(single).completions.create(
                model=model_folder.name, prompt=prompt, max_tokens=12, temperature=0.0
            ).choices[0].text
            for prompt in PROMPTS
        ]
    results = [None] * len(PROMPTS)

    def run(index):
        reply = client_of(router).completions.create(
            model=model_folder.name, prompt=PROMPTS[index], max_tokens=12, temperature=0.0
        )
        results[index] = reply.choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected
    assert sum(1 for count in requests_by_replica(router) if count > 0) > 1  # spread out


def test_a_repeated_prompt_returns_to_the_replica_that_cached_it(router, model_folder):
    client = client_of(router)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    client.chat.completions.create(model=model_folder.name, messages=messages, max_tokens=4)
    time.sleep(0.5)  # the replica's block events reach the router
    before = requests_by_replica(router)
    hits_before = router_metrics(router)[("pagedllm_router:routed_hit_tokens_total", "")]
    for question in ("What is a page?", "What is a block?", "What is a table?"):
        messages[1]["content"] = question
        client.chat.completions.create(model=model_folder.name, messages=messages, max_tokens=4)
        time.sleep(0.3)
    after = requests_by_replica(router)
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert sorted(grown) == [0, 0, 3]  # all three to one replica
    hits = router_metrics(router)[("pagedllm_router:routed_hit_tokens_total", "")]
    assert hits - hits_before >= 3 * 40  # the system prompt's blocks, each time


def test_streams_and_usage_pass_through(router, model_folder):
    before = router_metrics(router)[("pagedllm_router:generation_tokens_total", "")]
    stream = client_of(router).completions.create(
        model=model_folder.name, prompt="Stream this.", max_tokens=10, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 10
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text
    after = router_metrics(router)[("pagedllm_router:generation_tokens_total", "")]
    assert after - before == 10


def replica_processes(server) -> list[psutil.Process]:
    """The replicas' processes, in the router's order (they start in it)."""
    children = psutil.Process(server.process.pid).children()
    replicas = [child for child in children if "serve" in child.cmdline()]
    return sorted(replicas, key=psutil.Process.create_time)


def in_flight(server, index: int) -> float:
    return router_metrics(server)[("pagedllm_router:replica_in_flight", str(index))]


def test_a_replica_killed_mid_run_loses_only_its_streams(router, model_folder):
    client = client_of(router)
    outcomes = {"ok": 0, "stream_error": 0, "other": []}
    lock = threading.Lock()

    def complete(index):
        try:
            reply = client.completions.create(
                model=model_folder.name, prompt=f"Request {index}: go on.", max_tokens=400,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            with lock:
                outcomes["ok"] += reply.usage.completion_tokens == 400
        except Exception as error:  # noqa: BLE001 (recorded, then asserted on)
            with lock:
                outcomes["other"].append(repr(error))

    def stream(index):
        body = {"model": model_folder.name, "prompt": f"Stream {index}: go on.", "stream": True}
        body.update(max_tokens=400, ignore_eos=True)
        with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        with lock:
            if lines[-1] != "data: [DONE]":
                outcomes["other"].append(lines[-1])
            elif "replica_failed" in lines[-2]:
                outcomes["stream_error"] += 1
            else:
                outcomes["ok"] += 1

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(9)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    wait_until(lambda: in_flight(router, 0) >= 3, timeout=30)
    victim = replica_processes(router)[0]
    victim.send_signal(signal.SIGKILL)
    for thread in threads:
        thread.join()
    assert outcomes["other"] == []
    assert outcomes["ok"] + outcomes["stream_error"] == 15
    metrics = router_metrics(router)
    broken = metrics[("pagedllm_router:broken_streams_total", "")]
    resent = metrics[("pagedllm_router:resends_total", "")]
    assert broken == outcomes["stream_error"] < 6  # only the streams the victim was sending
    assert broken + resent >= 3  # what the victim held when it died: nothing else lost
    # the replica is started again and taken back
    wait_until(lambda: healthy_replicas(router) == REPLICAS)
    reply = client.completions.create(model=model_folder.name, prompt="After.", max_tokens=3)
    assert reply.choices[0].text is not None


def test_replicas_on_other_machines_join_through_the_rendezvous(model_folder):
    """Two "machines" on one: a router hosting the rendezvous, and two replicas started
    on their own that join it; a replica killed and started again on its port is taken
    back."""
    from pagedllm.engine.tensor_parallel.launch import free_port

    address = f"127.0.0.1:{free_port()}"
    router = ServerProcess(["--rendezvous", address], subcommand="router")
    started = threading.Thread(target=router.start)
    started.start()  # healthy once a replica has joined
    join = [*ENGINE_ARGS, "--model", str(model_folder), "--join-router", address]
    first, second = ServerProcess(join).start(), ServerProcess(join).start()
    try:
        started.join()
        wait_until(lambda: healthy_replicas(router) == 2)
        client = client_of(router)
        for index in range(4):
            reply = client.completions.create(
                model=model_folder.name, prompt=f"{index} - a replica that joined.", max_tokens=4
            )
            assert reply.usage.completion_tokens == 4
        assert all(count > 0 for count in requests_by_replica(router)[:2])
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        wait_until(lambda: healthy_replicas(router) == 1)
        again = ServerProcess(join, port=first.port).start()  # the same URL registers again
        wait_until(lambda: healthy_replicas(router) == 2)
        metrics = router_metrics(router)
        assert ("pagedllm_router:replica_healthy", "2") not in metrics  # not a third replica
        again.stop()
    finally:
        second.stop()
        first.stop()
        router.stop()
