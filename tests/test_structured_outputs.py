"""Structured outputs: 20 JSON schemas sampled at temperature 1.0 on the default model
all parse and validate (jsonschema is the oracle); choice, regex and grammar constraints
hold; bad constraints are refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from shared_models import default_model

from pagedllm import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedllm.engine.request_errors import InvalidRequestError
from pagedllm.engine.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer",
     "minimum": 1, "maximum": 9}}, "required": ["kind", "lives"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": NAME},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": NAME},
     "required": ["answer", "why"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, NAME]}},
     "required": ["value"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME, "population": {
        "type": "integer", "minimum": 0}}, "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
     "maxItems": 3}}, "required": ["flags"]},
    {"type": "object", "properties": {"outer": {"type": "object", "properties": {"inner": {
        "type": "object", "properties": {"leaf": NAME}, "required": ["leaf"]}},
        "required": ["inner"]}}, "required": ["outer"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "note": {"type": "null"}},
     "required": ["level", "note"]},
    {"type": "object", "properties": {"email": {
        "type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"]},
    {"type": "object", "properties": {"temperature": {"type": "number"}, "unit": {
        "enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900,
     "maximum": 2100}, "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]},
     "maxItems": 2}}, "required": ["title", "year"]},
]  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    engine = LLMEngine(
        EngineConfig(
            dtype="float32", kv_cache_memory="64MiB", max_model_len=512, log_stats_interval=0
        ),
        default_model(),
    )
    return LLM.from_engine(engine)


def chat_prompt(llm, schema) -> dict[str, list[int]]:
    ask = f"Reply with JSON matching this schema: {json.dumps(schema)}"
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": ask}])
    return {"prompt_token_ids": ids}


def test_twenty_schemas_at_temperature_one_all_validate(llm):
    assert len(SCHEMAS) == 20
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i, schema in enumerate(SCHEMAS)
    ]  # fmt: skip
    outputs = llm.generate([chat_prompt(llm, s) for s in SCHEMAS], params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_choice_regex_grammar_and_json_object(llm):
    prompt = chat_prompt(llm, {"type": "string"})
    cases = {
        "choice": StructuredOutputsParams(choice=["apple pie", "banana", "cherry (red)"]),
        "regex": StructuredOutputsParams(regex=r"[a-c]{2}-[0-9]{3}"),
        "grammar": StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe"'),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    params = [
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=160, structured_outputs=so)
        for so in cases.values()
    ]
    outputs = llm.generate([prompt] * len(cases), params, use_tqdm=False)
    texts = {kind: [c.text for c in out.outputs] for kind, out in zip(cases, outputs, strict=True)}
    assert all(t in ("apple pie", "banana", "cherry (red)") for t in texts["choice"])
    assert all(re.fullmatch(r"[a-c]{2}-[0-9]{3}", t) for t in texts["regex"])
    assert all(t in ("yes", "no", "maybe") for t in texts["grammar"])
    finished = [c.text for c in outputs[3].outputs if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished)


def test_bad_constraints_are_refused_naming_the_field(llm):
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidRequestError, match="does not compile") as caught:
        bad.check_for_model(engine.model_config.vocab_size, engine.tokenizer)
    assert caught.value.param == "structured_outputs"


def test_overhead_benchmark_runs():
    """``benchmarks/structured_output.py`` (two steps of two rows) prints its JSON line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "structured_output.py"
    done = subprocess.run(
        [sys.executable, str(script), "--batch", "2", "--steps", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["batch"] == 2 and result["constrained_ms_per_step"] > 0
