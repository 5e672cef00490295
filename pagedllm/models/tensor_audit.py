"""Every checkpoint tensor is read by the decoder or known to be unused.

A tensor the decoder never reads usually means a feature it does not implement (an
output-projection bias, a per-head norm, an expert): loading must fail then, naming
the tensor, rather than generate different tokens silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from pagedllm.models.errors import ModelLoadError

# Name suffixes that carry no weights the math reads: transformers' cached RoPE
# frequencies (recomputed from the config) are all there is.
KNOWN_UNUSED_SUFFIXES = ("rotary_emb.inv_freq",)


class TrackedSource:
    """Wraps a weight source and records each name read through it."""

    def __init__(self, get: Callable[[str], torch.Tensor]) -> None:
        self._get = get
        self.read: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self._get(name)


def refuse_unread(
    stored: Iterable[str], read: set[str], known_unused: set[str], where: str
) -> None:
    """Raise :class:`ModelLoadError` naming the stored tensors nobody read, except those in
    ``known_unused`` or ending in :data:`KNOWN_UNUSED_SUFFIXES`."""
    unread = sorted(
        name
        for name in stored
        if name not in read
        and name not in known_unused
        and not name.endswith(KNOWN_UNUSED_SUFFIXES)
    )
    if unread:
        shown = ", ".join(repr(n) for n in unread[:8])
        more = f" and {len(unread) - 8} more" if len(unread) > 8 else ""
        raise ModelLoadError(
            f"{where} holds tensors this decoder does not implement: {shown}{more}"
        )
