"""A bfloat16 model on the CPU keeps its residual stream and its logits in float32 (its
layers still multiply in bfloat16). On the default model its logits then stray from
float32's several times less (mean KL divergence over every prompt position) than with
the residual stream and the logits rounded to bfloat16, as transformers rounds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from shared_models import default_model as load_default_model
from test_models_logits import our_logits
from test_models_smollm2 import chat_ids

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "Write a haiku about the sea.", "Who wrote Hamlet?"]  # fmt: skip


def mean_kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float(
        F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                 reduction="none").sum(-1).mean()
    )  # fmt: skip


def test_float32_residual_and_logits_bring_bfloat16_closer_to_float32(
    default_model, monkeypatch
):
    prompts = [chat_ids(default_model.tokenizer, q) for q in QUESTIONS]
    reference = our_logits(default_model.model, prompts)
    model = load_default_model(torch.bfloat16).model
    assert model.residual_dtype == torch.float32
    ours = our_logits(model, prompts)
    assert ours.dtype == torch.float32 and not torch.equal(ours, ours.bfloat16().float())
    monkeypatch.setattr(model, "residual_dtype", torch.bfloat16)
    rounded = our_logits(model, prompts).bfloat16().float()
    assert mean_kl(ours, reference) < 0.5 * mean_kl(rounded, reference)
