"""The request fields that ask for structured outputs, and their translation.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)
and vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar`` all become one :class:`StructuredOutputsParams`; a request may use
only one of them. ``structured_outputs.disable_any_whitespace`` (vLLM's field) makes
JSON compact (true) or free in whitespace (false) for this request; absent, the
engine's ``disable_any_whitespace`` decides.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.request_errors import InvalidRequestError
from pagedllm.structured_output import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema under ``schema`` (``strict`` and
    ``name`` are accepted; the output always follows the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into the generation requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The one constraint asked for, or None; InvalidRequestError naming the field
        when two are given or one is incomplete."""
        given = {name: value for name, value in self._sources().items() if value is not None}
        if len(given) > 1:
            raise InvalidRequestError(
                f"give at most one of {', '.join(given)}", param=next(iter(given))
            )
        if not given:
            return None
        ((name, params),) = given.items()
        return params

    def _sources(self) -> dict[str, StructuredOutputsParams | None]:
        sources: dict[str, StructuredOutputsParams | None] = {
            "response_format": self._response_format(),
            "structured_outputs": None,
        }
        if self.structured_outputs is not None:
            so = self.structured_outputs
            sources["structured_outputs"] = _params(
                "structured_outputs",
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=bool(so.json_object),
                compact_json=so.disable_any_whitespace,
            )
        guided = {
            "guided_json": ("json", self.guided_json),
            "guided_regex": ("regex", self.guided_regex),
            "guided_choice": ("choice", self.guided_choice),
            "guided_grammar": ("grammar", self.guided_grammar),
        }
        for name, (kind, value) in guided.items():
            sources[name] = None if value is None else _params(name, **{kind: value})
        return sources

    def _response_format(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return _params("response_format", json_object=True)
        if fmt.json_schema is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs 'json_schema'", "response_format"
            )
        return _params("response_format", json=fmt.json_schema.json_schema)


def _params(field: str, **kwargs: object) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequestError as error:
        raise InvalidRequestError(str(error), field) from None
