"""Speculative decoding's parts that need no model: the configuration, the proposers
that guess a sequence's next tokens from its own history (n-gram prompt lookup, suffix
trees), the rule that picks how many tokens to guess each step, and the acceptance
counters. The engine side (scheduling the guesses, verifying them against the model,
rolling rejected slots back) lives in :mod:`pagedllm.engine.speculation`."""
