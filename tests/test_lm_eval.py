"""lm-eval's ``local-completions`` client against a live server equals lm-eval's own
``hf`` model on the same weights: a multiple-choice loglikelihood task (scored with
``echo`` and prompt logprobs) and a generate_until task, written by the test."""

from __future__ import annotations

import json
import random

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

NUM_DOCS = 24
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "rain", "tree", "stone", "river"]

TASKS = {
    "pagedllm_mc": """\
task: pagedllm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "pagedllm_gen": """\
task: pagedllm_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    rng = random.Random(0)
    docs = []
    for _ in range(NUM_DOCS):
        choices = rng.sample(WORDS, 4)
        question = f"Q: which of {', '.join(choices)} comes to mind with {rng.choice(WORDS)}?\nA:"
        docs.append({"question": question, "choices": [f" {c}" for c in choices],
                     "answer": rng.randrange(4)})  # fmt: skip
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    for name, template in TASKS.items():
        (folder / f"{name}.yaml").write_text(template.format(data=data))
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-eval"))


def evaluate(model: str, model_args: str, task_folder) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_folder)),
        batch_size=4,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
    )


def by_doc(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [sample["filtered_resps"] for sample in samples]


def test_server_scores_like_lm_evals_hf_model(model_folder, task_folder, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--model", str(model_folder), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    args += ["--max-model-len", "512"]
    with ServerProcess([*args, "--log-stats-interval", "0"]) as server:
        served = evaluate(
            "local-completions",
            f"model={model_folder.name},base_url={server.base_url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={model_folder},num_concurrent=2,"
            "max_retries=1,tokenized_requests=True",
            task_folder,
        )
    reference = evaluate("hf", f"pretrained={model_folder},dtype=float32", task_folder)
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["pagedllm_mc"][metric] == reference["results"]["pagedllm_mc"][
            metric
        ]
    ours, theirs = by_doc(served, "pagedllm_mc"), by_doc(reference, "pagedllm_mc")
    assert len(ours) == NUM_DOCS
    for our_doc, their_doc in zip(ours, theirs, strict=True):
        for (our_ll, our_greedy), (their_ll, their_greedy) in zip(our_doc, their_doc, strict=True):
            assert our_ll == pytest.approx(their_ll, abs=1e-3)
            assert our_greedy == their_greedy
    # the random byte-level model often stops (max_gen_toks) inside a UTF-8 character:
    # transformers decodes the partial bytes to U+FFFD, a server never sends a partial
    # character (as vLLM); the texts must otherwise be the same
    for ours, theirs in zip(by_doc(served, "pagedllm_gen"), by_doc(reference, "pagedllm_gen"),
                            strict=True):  # fmt: skip
        (our_text,), (their_text,) = ours, theirs
        assert their_text.startswith(our_text)
        assert set(their_text[len(our_text) :]) <= {"\ufffd"}
    assert (
        served["results"]["pagedllm_gen"]["exact_match,none"]
        == reference["results"]["pagedllm_gen"]["exact_match,none"]
    )
