"""How far a bfloat16 model's logits stray from float32's (JSON lines).

On the CPU a bfloat16 model keeps its residual stream and its logits in float32; its
matrix products, attention and elementwise kernels run in bfloat16. This compares, on
every position of a set of chat prompts, the float32 model's logits (equal to
transformers' float32 within 1e-4, as the tests check) with:

- ``engine``: the bfloat16 model as it runs;
- ``rounded``: the same with the residual stream and the logits rounded to bfloat16, as
  transformers (and most engines) run bfloat16;
- ``transformers`` (with ``--transformers``): transformers' own bfloat16 model, loaded
  from the same GGUF.

Per variant: the mean KL divergence from float32's distribution (nats), the mean
absolute logit difference, the share of positions whose most likely token is float32's,
and the same for the last position of each prompt (the first generated token).

    python benchmarks/bfloat16_fidelity.py [--model PATH] [--quantization none] [--transformers]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata
from pagedllm.bench.machine import machine_record
from pagedllm.models import load_model

QUESTIONS = [
    "What is the capital of France?", "Explain paged memory in one sentence.",
    "Write a haiku about the sea.", "How many legs does a spider have?", "Who wrote Hamlet?",
    "What is 17 times 3?", "Name three primary colors.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.", "What is photosynthesis?",
    "List the planets of the solar system.", "What does a CPU do?",
    "Summarize the plot of Cinderella in one sentence.", "What is the largest ocean?",
]  # fmt: skip


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        hidden = model(ids, positions, DenseAttentionBackend(), dense_metadata([len(prompt)]))
        return model.compute_logits(hidden)


def record(variant: str, logits: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    ours, ref = torch.cat(logits).float(), torch.cat(reference)
    kl = F.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    last = [int(a[-1].argmax() == r[-1].argmax()) for a, r in zip(logits, reference, strict=True)]
    return {
        "record": "fidelity",
        "variant": variant,
        "positions": len(ref),
        "mean_kl_nats": round(float(kl.sum(-1).mean()), 6),
        "mean_abs_logit_error": round(float((ours - ref).abs().mean()), 4),
        "top1_agreement": round(float((ours.argmax(-1) == ref.argmax(-1)).float().mean()), 4),
        "first_token_agreement": f"{sum(last)}/{len(last)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--transformers", action="store_true")
    args = parser.parse_args()
    print(json.dumps(machine_record()), flush=True)
    full = load_model(args.model, torch.float32, quantization=args.quantization)
    prompts = [full.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in QUESTIONS]  # fmt: skip
    reference = [prompt_logits(full.model, p) for p in prompts]
    half = load_model(args.model, torch.bfloat16, quantization=args.quantization).model
    variants = {"engine": [prompt_logits(half, p) for p in prompts]}
    half.residual_dtype = torch.bfloat16
    variants["rounded"] = [prompt_logits(half, p).bfloat16() for p in prompts]
    if args.transformers:
        from transformers import AutoModelForCausalLM

        path = full.source
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.bfloat16)  # fmt: skip
        with torch.inference_mode():
            variants["transformers"] = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for variant, logits in variants.items():
        print(json.dumps(record(variant, logits, reference)), flush=True)


if __name__ == "__main__":
    main()
