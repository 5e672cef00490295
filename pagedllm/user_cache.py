"""The user's cache folder: what pagedllm measures or converts once and keeps between
runs (kernel timings, tokenizers converted from GGUF metadata, the lengths of the requests
a server finished). Everything in it can be deleted at any time; it is made again on the
next start."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else
    ``~/.cache/pagedllm``."""
    explicit = os.environ.get("PAGEDLLM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedllm"
