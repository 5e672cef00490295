"""Options that take one of a few named values (``preemption_mode``, ``linear_kernel``,
``kv_cache_dtype``, ...): each is a :class:`Choice` enum, defined beside the code its
values steer, and read from user input by :func:`parse_choice`, the one check."""

from __future__ import annotations

import enum
from typing import TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, enum.Enum):
    """A named value of an option. A member is its text (it compares and hashes equal
    to it, prints as it and is stored as it in JSON), so text from flags, caches and
    configs needs no translation, and a member finds a dict entry keyed by its text."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The allowed texts, in declaration order."""
        return tuple(member.value for member in cls)


def parse_choice(kind: type[C], value: object, option: str) -> C:
    """``value`` (a member or its text) as a member of ``kind``; ValueError naming
    ``option`` and every allowed value otherwise."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(kind.values())
        raise ValueError(f"{option} must be one of {allowed}, got {value!r}") from None
