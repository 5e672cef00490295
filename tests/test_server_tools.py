"""Tool calling through the official ``openai`` SDK against a live server (tiny random
chat model whose template knows no tools, so the fallback rendering is used): required
and named choices constrained to valid arguments, ``auto`` parsing the model's
``<tool_call>`` text, streamed deltas, tool turns in the history; and a template that
renders tools, against transformers' own rendering."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess
from pagedllm.server.tool_call_format import parse_tool_calls

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# the fallback rendering of the tools takes ~850 byte tokens
SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "4096"]
SERVE_ARGS += ["--log-stats-interval", "0"]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        # a random byte-level model writes invalid UTF-8 into free strings (decoded as
        # U+FFFD, which breaks maxLength counts): a pattern keeps them to letters
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}}},
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]  # fmt: skip


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat-tools")
    return write_tiny_chat_llama(folder, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def client(model_folder):
    with ServerProcess(["--model", str(model_folder), *SERVE_ARGS]) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(client, **fields):
    settings = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS)
    return client.chat.completions.create(**{**settings, **fields})


def assert_valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert call.type == "function" and call.id
    return arguments


def test_required_calls_always_validate(client):
    reply = chat(client, tool_choice="required", temperature=1.0, seed=3, n=6, max_tokens=400)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", repr(choice.message.content)
        assert choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert_valid(call)


def test_parallel_tool_calls_false_makes_one_call(client):
    reply = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                 seed=4, n=4, max_tokens=400)  # fmt: skip
    assert all(len(choice.message.tool_calls) == 1 for choice in reply.choices)


def test_named_function_streams_the_same_arguments(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    fields = dict(tool_choice=named, temperature=1.0, seed=9, max_tokens=200)
    whole = chat(client, **fields).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time" and whole.finish_reason == "stop"
    assert_valid(call)
    deltas = [c.choices[0].delta for c in chat(client, stream=True, **fields) if c.choices]
    pieces = [tc for delta in deltas for tc in delta.tool_calls or []]
    assert pieces[0].function.name == "get_time" and pieces[0].id
    assert all(piece.index == 0 for piece in pieces)
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_auto_parses_the_models_tool_call_text(client):
    written = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", ' \
              '"unit": "celsius"}}</tool_call>'  # fmt: skip
    regex = {"guided_regex": re.escape(written)}
    fields = dict(tool_choice="auto", max_tokens=300, extra_body=regex)
    whole = chat(client, **fields).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert assert_valid(call) == {"city": "Oslo", "unit": "celsius"}
    chunks = [c.choices[0] for c in chat(client, stream=True, **fields) if c.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert content == "Sure." and chunks[-1].finish_reason == "tool_calls"
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_none_and_plain_text_give_content_only(client):
    for fields in ({"tool_choice": "none"}, {"extra_body": {"guided_regex": "[a-z ]{5,20}"}}):
        choice = chat(client, max_tokens=20, temperature=0.0, **fields).choices[0]
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


def test_history_with_tool_calls_and_results(client):
    reply = chat(client, messages=HISTORY, max_tokens=8, temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    base = str(client.base_url).removesuffix("/v1/")
    rendered = httpx.post(f"{base}/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()
    assert reply.usage.prompt_tokens == rendered["count"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_impossible_tool_choices_are_refused(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **fields)
    assert caught.value.body["param"] == param


def test_the_tool_format_parser():
    assert parse_tool_calls("plain") == ("plain", [])
    content, calls = parse_tool_calls('a <tool_call>{"name": "f", "parameters": {"x": 1}}')
    assert content == "a"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []


def test_templates_that_render_tools_get_them_as_transformers_passes_them(tmp_path):
    from transformers import AutoTokenizer

    from pagedllm.server.chat import chat_prompt
    from pagedllm.server.protocol import ChatCompletionRequest
    from pagedllm.tokenizer import Tokenizer

    folder = write_tiny_chat_llama(tmp_path / "with-tools", chat_template=TOOLS_TEMPLATE)
    ours = Tokenizer.from_folder(folder)
    body = ChatCompletionRequest(messages=HISTORY, tools=TOOLS)
    prompt = chat_prompt(ours, body.template_messages(), body.tool_plan.template_tools())
    theirs = AutoTokenizer.from_pretrained(folder)
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "celsius"}
    expected = theirs.apply_chat_template(
        history, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(prompt.messages, tools=prompt.tools) == list(expected)
    plain = Tokenizer.from_folder(write_tiny_chat_llama(tmp_path / "plain"))
    fallback = chat_prompt(plain, body.template_messages(), body.tool_plan.template_tools())
    ids = plain.apply_chat_template(fallback.messages)
    text = plain.decode(ids, skip_special_tokens=False)
    assert fallback.tools is None and '"get_time"' in text
    assert '<tool_call>\n{"name": "get_weather"' in text and "<tool_response>" in text
