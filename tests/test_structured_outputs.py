"""Structured outputs: 20 JSON schemas sampled at temperature 1.0 on the default model
all parse and validate (jsonschema is the oracle); choice, regex and grammar constraints
hold; bad constraints are refused naming the field; compact JSON (the engine's
``disable_any_whitespace`` or a request's ``compact_json``) forbids free whitespace."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from shared_models import default_model

from pagedllm import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.structured_output import StructuredOutputsParams, allocate_bitmask

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


COMPACT_BY_DEFAULT = True
"""The chosen default of ``disable_any_whitespace`` (see docs/structured_outputs.md)."""


def allowed_after(engine, params: StructuredOutputsParams, text: str) -> set[int]:
    """Token ids the engine's grammar for ``params`` allows after the output ``text``."""
    vocab = engine.model_config.vocab_size
    matchers = engine.tokenizer.grammar_compiler(vocab)(params)
    bitmask = allocate_bitmask(1, vocab)
    matchers.fill_mask(engine.tokenizer.encode(text, add_special_tokens=False), bitmask, 0)
    words = bitmask[0].tolist()
    return {t for t in range(vocab) if words[t // 32] >> (t % 32) & 1}


@pytest.fixture(scope="module")
def whitespace_ids(llm):
    """Ids of the tokens that are whitespace alone (spaces, newlines, tabs)."""
    engine = llm.llm_engine
    texts = (engine.tokenizer.decode([t]) for t in range(engine.model_config.vocab_size))
    return {t for t, text in enumerate(texts) if text and text.isspace()}


@pytest.fixture(scope="module")
def other_engine(llm):
    """An engine sharing ``llm``'s loaded model, with the other whitespace default."""
    config = EngineConfig(
        dtype="float32", kv_cache_memory="16MiB", max_model_len=256, log_stats_interval=0,
        disable_any_whitespace=not COMPACT_BY_DEFAULT,
    )  # fmt: skip
    return LLMEngine(config, llm.llm_engine.loaded)


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_compact_json_refuses_whitespace_after_a_brace(llm, whitespace_ids, kind):
    engine = llm.llm_engine
    constraint = {"json": SCHEMAS[11]} if kind == "json" else {"json_object": True}
    free = allowed_after(engine, StructuredOutputsParams(**constraint, compact_json=False), "{")
    compact = allowed_after(engine, StructuredOutputsParams(**constraint, compact_json=True), "{")
    assert free & whitespace_ids  # any JSON whitespace may open the object
    assert compact and not compact & whitespace_ids
    assert compact < free  # the same tokens less the whitespace
    default = allowed_after(engine, StructuredOutputsParams(**constraint), "{")
    assert default == (compact if COMPACT_BY_DEFAULT else free)


def test_engine_default_is_per_engine_and_requests_override_it(llm, other_engine):
    assert EngineConfig().disable_any_whitespace is COMPACT_BY_DEFAULT
    engine = llm.llm_engine
    assert engine.tokenizer.compact_json is COMPACT_BY_DEFAULT
    assert other_engine.tokenizer.compact_json is not COMPACT_BY_DEFAULT
    assert engine.loaded is other_engine.loaded  # one model, two settings
    params = StructuredOutputsParams(json=SCHEMAS[3])
    mine, other = allowed_after(engine, params, "{"), allowed_after(other_engine, params, "{")
    assert mine != other
    asked = StructuredOutputsParams(json=SCHEMAS[3], compact_json=not COMPACT_BY_DEFAULT)
    assert allowed_after(engine, asked, "{") == other


def test_compact_outputs_have_one_space_after_separators_and_no_other(llm):
    """Sampled at temperature 1 under compact JSON: outside strings, a space only after
    ``,`` or ``:`` (xgrammar's fixed separators), never a newline or tab."""
    schemas = [SCHEMAS[i] for i in (1, 5, 6, 10, 13, 19)]
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=schema, compact_json=True),
        )
        for i, schema in enumerate(schemas)
    ]  # fmt: skip
    outputs = llm.generate([chat_prompt(llm, s) for s in schemas], params, use_tqdm=False)
    for schema, output in zip(schemas, outputs, strict=True):
        text = output.outputs[0].text
        jsonschema.validate(json.loads(text), schema)
        skeleton = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)  # strings emptied
        assert not re.search(r"[\n\r\t]|(?<![,:]) ", skeleton), text


def test_whitespace_benchmark_runs():
    """``benchmarks/structured_whitespace.py`` (8 tokens a request) prints a line per
    temperature, prompt and whitespace mode after the CPU's."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "structured_whitespace.py"
    done = subprocess.run(
        [sys.executable, str(script), "--seeds", "1", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert "cpu" in lines[0] and len(lines) == 9
    modes = {(line["whitespace"], line["mean_tokens"] <= 8) for line in lines[1:]}
    assert modes == {("any", True), ("compact", True)}
