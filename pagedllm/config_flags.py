"""Command-line flags generated from :class:`~pagedllm.config.EngineConfig`'s fields.

Every field becomes ``--field-name`` with the field's default, allowed values and help
(:func:`~pagedllm.config.knob`), so ``pagedllm generate``, ``chat``, ``serve`` and
``bench`` offer every knob ``LLM(...)`` takes, under the same names, with nothing
copied by hand. Booleans get both forms (``--enforce-eager`` / ``--no-enforce-eager``).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from pagedllm.config import EngineConfig

# How a field's annotation (a string under postponed evaluation) is read from the command
# line; a knob with its own parser (sizes such as "2GiB", devices, dtypes, choices) and
# any other annotation is passed on as text for EngineConfig to parse.
_PARSERS = {"int": int, "int | None": int, "float": float}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_flags(
    parser: argparse.ArgumentParser, exclude: Collection[str] = ()
) -> argparse._ArgumentGroup:
    """Add a flag for every EngineConfig field not in ``exclude``; returns their group."""
    group = parser.add_argument_group("engine (the fields of LLM(...) and EngineConfig)")
    for spec in fields(EngineConfig):
        if spec.name in exclude:
            continue
        options: dict[str, Any] = {
            "dest": spec.name,
            "default": spec.default,
            "help": spec.metadata["help"],
        }
        if spec.type == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            parsed_by_config = spec.metadata["parse"] or spec.metadata["choice"]
            options["type"] = str if parsed_by_config else _PARSERS.get(str(spec.type), str)
            if spec.metadata["choices"] is not None:
                options["choices"] = spec.metadata["choices"]
        group.add_argument(flag_name(spec.name), **options)
    return group


def config_from_flags(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the parsed flags describe; ``overrides`` replace fields (and
    supply the excluded ones)."""
    values = {
        spec.name: getattr(args, spec.name)
        for spec in fields(EngineConfig)
        if hasattr(args, spec.name)
    }
    values.update(overrides)
    return EngineConfig(**values)
