"""A draft model must speak the target's vocabulary: its guesses are token ids the
target verifies, so one id must mean one token in both."""

from __future__ import annotations

from pagedllm.models.loader import LoadedModel


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """ValueError naming the first difference between the two models' vocabularies: their
    sizes (logit rows), then, where both carry a tokenizer, the token each id stands
    for, then their end-of-sequence ids. A draft without a tokenizer (dummy weights) is
    compared by size alone."""
    sizes = target.config.vocab_size, draft.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"speculative_config: the draft model {draft.source.name} has a vocabulary of "
            f"{sizes[1]} tokens, the target {target.source.name} {sizes[0]}; a draft "
            "model needs the target's vocabulary"
        )
    if target.tokenizer is None or draft.tokenizer is None:
        return
    target_ids, draft_ids = target.tokenizer.vocabulary(), draft.tokenizer.vocabulary()
    for token, token_id in sorted(target_ids.items(), key=lambda item: item[1]):
        other = draft_ids.get(token)
        if other != token_id:
            where = "has no such token" if other is None else f"gives it id {other}"
            raise ValueError(
                f"speculative_config: the target's token {token!r} is id {token_id}; the "
                f"draft model {draft.source.name} {where}. A draft model needs the "
                "target's vocabulary"
            )
    extra = sorted(set(draft_ids) - set(target_ids))
    if extra:
        raise ValueError(
            f"speculative_config: the draft model {draft.source.name} has tokens the "
            f"target lacks, e.g. {extra[0]!r}; a draft model needs the target's vocabulary"
        )
