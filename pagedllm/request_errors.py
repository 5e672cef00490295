"""The error for a request that can never run as asked.

``InvalidRequestError`` is raised before anything is queued or allocated: a field out
of range, a prompt too long, a worst case larger than the KV pool. ``param`` names the
offending field when there is one (``None`` for the prompt as a whole). It is a
``ValueError``, so code that catches ``ValueError`` keeps working.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request refused before it was queued; ``param`` is the field to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
