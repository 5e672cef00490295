"""What a stored block's bytes depend on beyond its tokens: the tier fingerprint.

A block's content digest names its tokens, every token before them and the request's
extra keys (the model's path and dtype, a tenant's salt). Its bytes also depend on the
weights behind that path, the K/V element format, the block size and the pool's shape.
The fingerprint is SHA-256 over all of them; a disk entry written under another
fingerprint is foreign and never read as K/V. The weights are named by each
checkpoint file's path, size and modification time (reading gigabytes of weights at
every start to hash them would cost more than the cache saves): a file replaced in
place changes its size or time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def checkpoint_identity(source: Path) -> list[tuple[str, int, int]]:
    """``(name, bytes, mtime_ns)`` of the files a model was loaded from: ``source`` itself
    when it is a file, else its files (a Hugging Face folder), sorted by name."""
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


def tier_fingerprint(
    source: Path, cache_tensor: torch.Tensor, kv_format: str, block_size: int
) -> bytes:
    """The fingerprint (32 bytes) of blocks of the pool ``cache_tensor`` (its shape and
    element type), in ``kv_format``, ``block_size`` tokens each, computed by the model
    loaded from ``source``."""
    identity = {
        "checkpoint": [str(source.resolve()), checkpoint_identity(source)],
        "pool_shape": [d for i, d in enumerate(cache_tensor.shape) if i != 2],
        "element": str(cache_tensor.dtype),
        "kv_format": kv_format,
        "block_size": block_size,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
