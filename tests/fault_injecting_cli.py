"""``pagedllm``'s CLI with two faults that a test triggers by prompt text, run as a
script (``python tests/fault_injecting_cli.py serve ...``) so that the server under
test is the real process a user runs, plus these faults:

- ``DECODER_FAULT`` in a text prompt: that request's streaming decoder raises on its
  third token (a per-request failure inside the engine step);
- ``LOOP_KILLER`` in a text prompt: the next engine step raises ``SystemExit``, which
  no request-level handler may swallow, so the engine loop thread dies.
"""

from __future__ import annotations

import sys

from pagedllm.cli import main
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.tokenizer import Tokenizer

DECODER_FAULT = "<<decoder-fault>>"
LOOP_KILLER = "<<kill-the-loop>>"
FAULT_AFTER_TOKENS = 2


class FailingDecoder:
    def __init__(self, real) -> None:
        self.real = real
        self.tokens = 0

    def add(self, token_id: int) -> str:
        self.tokens += 1
        if self.tokens > FAULT_AFTER_TOKENS:
            raise RuntimeError("injected decoder fault")
        return self.real.add(token_id)


def install_faults() -> None:
    real_decoder = Tokenizer.incremental_decoder
    real_step = LLMEngine.step

    def incremental_decoder(self, prompt_ids=None):
        made = real_decoder(self, prompt_ids)
        context = self.decode(list(prompt_ids or []), skip_special_tokens=False)
        return FailingDecoder(made) if DECODER_FAULT in context else made

    def step(self):
        if any(LOOP_KILLER in (state.prompt or "") for state in self._requests.values()):
            raise SystemExit("injected loop fault")
        return real_step(self)

    Tokenizer.incremental_decoder = incremental_decoder
    LLMEngine.step = step


if __name__ == "__main__":
    install_faults()
    sys.exit(main())
