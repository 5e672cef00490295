"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` SDK
against one live server (tiny random chat model; its template knows no tools, so
function tools take the fallback rendering): the Response object, greedy equality with
``/v1/chat/completions`` on the same messages, the streamed event sequence, function
calls and their results sent back, ``text.format``, ``previous_response_id`` chains,
the store (GET, DELETE, ``store: false``), output logprobs, and the 400s and 404s. The
server runs under tests/fault_injecting_cli.py, so one test can fail a request inside
the engine mid-stream."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import pydantic
import pytest
from fault_injecting_cli import DECODER_FAULT
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.field_policy import IGNORED_FIELDS_HEADER
from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ENTRY = [sys.executable, str(Path(__file__).with_name("fault_injecting_cli.py"))]
# the fallback rendering of the tools takes ~850 byte tokens
SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "4096"]
SERVE_ARGS += ["--log-stats-interval", "0"]
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
WEATHER = {
    "type": "object",
    "properties": {
        # letters only: a random byte-level model writes invalid UTF-8 into free strings
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat-responses")
    return write_tiny_chat_llama(folder, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model_folder):
    with ServerProcess(["--model", str(model_folder), *SERVE_ARGS], entry=ENTRY) as process:
        yield process


def respond(client, model_name, **fields):
    return client.responses.create(model=model_name, **fields)


def chat_text(client, model_name, messages, max_tokens=12, **fields):
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=max_tokens, temperature=0.0, **fields
    )
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def prompt_tokens(http, messages, tools=None) -> int:
    body = {"messages": messages} if tools is None else {"messages": messages, "tools": tools}
    return http.post("/tokenize", json=body).json()["count"]


def chat_tools():
    return [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in TOOLS
    ]


def test_a_plain_response_and_its_echoed_parameters(client, model_name):
    response = respond(client, model_name, input="Hello", instructions="Be brief.",
                       metadata={"run": "7"}, user="u1", top_p=0.9, **GREEDY)  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == model_name and response.created_at > 0
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens <= 12 and usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == 12 and message.status == "incomplete"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert (response.instructions, response.metadata, response.user) == (
        "Be brief.",
        {"run": "7"},
        "u1",
    )
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.0, 0.9, 12)
    assert response.tool_choice == "auto" and response.tools == []
    assert response.parallel_tool_calls is True and response.text.format.type == "text"


def test_greedy_output_equals_the_chat_completion_of_the_same_messages(client, model_name, http):
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer in French."}]},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello there"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More"}]},
    ]
    response = respond(client, model_name, input=items, instructions="Be brief.", **GREEDY)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "More"},
    ]
    text, prompt_len = chat_text(client, model_name, messages)
    assert response.output_text == text
    assert response.usage.input_tokens == prompt_len == prompt_tokens(http, messages)


def test_streamed_events_add_up_to_the_whole_response(client, model_name):
    whole = respond(client, model_name, input="Tell me a story", **GREEDY)
    events = list(respond(client, model_name, input="Tell me a story", stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == len(kinds) - 8 and len(deltas) > 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all((e.item_id, e.output_index, e.content_index) == (item_id, 0, 0) for e in deltas)
    text = "".join(event.delta for event in deltas)
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and final.output_text == text
    assert final.output[0].id == item_id and final.usage == whole.usage
    assert final.status == whole.status


def test_the_sdk_stream_helper_accumulates_the_response(client, model_name):
    with client.responses.stream(model=model_name, input="Hi", **GREEDY) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(texts)
    assert final.output_text == respond(client, model_name, input="Hi", **GREEDY).output_text


def test_the_wire_format_is_named_server_sent_events(http, model_name):
    body = {"model": model_name, "input": "Hi", "stream": True, **GREEDY}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line == f"event: {json.loads(data_line.removeprefix('data: '))['type']}"


def test_a_cut_response_is_incomplete(client, model_name):
    for stream in (False, True):
        fields = dict(input="Hi", max_output_tokens=5, extra_body={"ignore_eos": True})
        response = respond(client, model_name, stream=stream, **fields)
        if stream:
            response = list(response)[-1].response
        assert response.status == "incomplete" and response.usage.output_tokens == 5
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"


def test_a_required_call_and_its_result_sent_back(client, model_name, http):
    first = respond(client, model_name, input=QUESTION, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, temperature=1.0, max_output_tokens=300,
                    extra_body={"seed": 3})  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"t": 21}'}
    second = respond(client, model_name, previous_response_id=first.id, input=[result],
                     tools=TOOLS, tool_choice="none", **GREEDY)  # fmt: skip
    assert second.output[0].type == "message" and second.previous_response_id == first.id
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"t": 21}'},
    ]  # fmt: skip
    assert second.usage.input_tokens == prompt_tokens(http, history, chat_tools())
    text, _ = chat_text(client, model_name, history, tools=chat_tools(), tool_choice="none")
    assert second.output_text == text


def test_the_output_items_sent_back_as_input(client, model_name, http):
    first = respond(client, model_name, input=QUESTION, tools=TOOLS, tool_choice="required",
                    temperature=1.0, max_output_tokens=300, extra_body={"seed": 5})  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls
    ]
    items = [{"role": "user", "content": QUESTION}, *first.output, *results]
    second = respond(client, model_name, input=items, tools=TOOLS, store=False, **GREEDY)
    assert second.output and second.store is False
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name,
             "arguments": c.arguments}} for c in calls]},
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "ok"} for c in calls],
    ]  # fmt: skip
    assert second.usage.input_tokens == prompt_tokens(http, history, chat_tools())


def test_a_named_function_streams_its_arguments(client, model_name):
    fields = dict(input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                  max_output_tokens=200, temperature=0.0)  # fmt: skip
    whole = respond(client, model_name, **fields)
    (call,) = whole.output
    assert call.name == "get_time" and whole.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME)
    events = list(respond(client, model_name, stream=True, **fields))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments == call.arguments
    final = events[-1].response
    assert final.output[0].call_id == added.item.call_id and final.output[0].status == "completed"
    assert not any(e.type.startswith("response.output_text") for e in events)


def test_text_format_json_schema_and_json_object(client, model_name):
    schema = {**WEATHER, "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    for seed in range(3):
        response = respond(client, model_name, input="Weather?", text=text, temperature=1.0,
                           max_output_tokens=300, extra_body={"seed": seed})  # fmt: skip
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "weather"
    # any object: a random model may write one key for longer than max_output_tokens
    completed, any_object = [], {"format": {"type": "json_object"}}
    for seed in range(4):
        response = respond(client, model_name, input="JSON?", text=any_object, temperature=1.0,
                           max_output_tokens=300, extra_body={"seed": seed})  # fmt: skip
        assert response.output_text.startswith("{")
        if response.status == "completed":
            completed.append(json.loads(response.output_text))
    assert completed and all(isinstance(value, dict) for value in completed)


def test_the_sdk_parses_a_pydantic_text_format(client, model_name):
    class Forecast(pydantic.BaseModel):
        unit: Literal["celsius", "fahrenheit"]
        days: int

    parsed = client.responses.parse(model=model_name, input="Forecast?", text_format=Forecast,
                                    temperature=1.0, max_output_tokens=300,
                                    extra_body={"seed": 2})  # fmt: skip
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.output_parsed == Forecast.model_validate_json(parsed.output_text)


def test_previous_response_id_continues_the_conversation(client, model_name, http):
    first = respond(client, model_name, input="Hi", instructions="Be kind.", **GREEDY)
    second = respond(client, model_name, previous_response_id=first.id, input="And then?",
                     **GREEDY)  # fmt: skip
    third = respond(client, model_name, previous_response_id=second.id, input="Why?", **GREEDY)
    # instructions are not carried over, as in OpenAI's API
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    text, prompt_len = chat_text(client, model_name, messages)
    assert second.output_text == text and second.usage.input_tokens == prompt_len
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
    text, prompt_len = chat_text(client, model_name, messages)
    assert third.output_text == text and third.usage.input_tokens == prompt_len
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens


def test_a_streamed_response_is_stored_and_continued(client, model_name):
    events = list(respond(client, model_name, input="Hi", stream=True, **GREEDY))
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    later = respond(client, model_name, previous_response_id=streamed.id, input="Go on", **GREEDY)
    assert later.usage.input_tokens > streamed.usage.input_tokens + streamed.usage.output_tokens


def test_retrieve_delete_and_store_false(client, model_name, http):
    response = respond(client, model_name, input="Hi", **GREEDY)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    replay = http.get(f"/v1/responses/{response.id}", params={"stream": "true"})
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"
    client.responses.delete(response.id)
    for gone in (response.id, respond(client, model_name, input="Hi", store=False, **GREEDY).id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError) as caught:
            respond(client, model_name, previous_response_id=gone, input="More", **GREEDY)
        assert caught.value.code == "previous_response_not_found"
        assert caught.value.body["param"] == "previous_response_id"


def test_output_logprobs_when_included(client, model_name):
    fields = dict(
        input="Hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=6,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    part = respond(client, model_name, **fields).output[0].content[0]
    assert len(part.logprobs) == 6
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    assert part.logprobs[0].top_logprobs[0].token == part.logprobs[0].token  # greedy: the top
    events = list(respond(client, model_name, stream=True, **fields))
    streamed = [e for event in events if event.type == "response.output_text.delta"
                for e in event.logprobs]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    without = respond(client, model_name, input="Hi", **GREEDY).output[0].content[0]
    assert without.logprobs == []


def test_a_failure_mid_stream_is_an_error_event(client, model_name):
    fields = dict(
        input=f"{DECODER_FAULT} hi", max_output_tokens=24, extra_body={"ignore_eos": True}
    )
    events = list(respond(client, model_name, stream=True, **fields))
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert "injected decoder fault" in events[-1].message and events[-1].code
    with pytest.raises(openai.InternalServerError):
        respond(client, model_name, **fields)


def test_unknown_fields_are_named_and_sdk_hints_accepted(http, model_name):
    body = {"model": model_name, "input": "Hi", "service_tier": "auto", "prompt_cache_key": "k",
            "frobnicate": 1, "n": 1, "reasoning": {"effort": "none"},
            "include": ["reasoning.encrypted_content"], "truncation": "disabled",
            "background": False, **GREEDY}  # fmt: skip
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200
    named = response.headers[IGNORED_FIELDS_HEADER].split(", ")
    assert set(named) == {"service_tier", "prompt_cache_key", "frobnicate", "n"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"n": 2}, "n"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"priority": 5}, "priority"),
    ],
)
def test_what_is_not_served_is_refused_by_name(http, model_name, fields, param):
    response = http.post("/v1/responses", json={"model": model_name, "input": "Hi", **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "unsupported_field"), error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [{"type": "function", "name": "f", "frobnicate": 1}]}, "tools"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
        ),
        ({"tools": TOOLS, "include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"role": "user"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ],
)
def test_invalid_values_are_refused_by_name(http, model_name, fields, param):
    response = http.post("/v1/responses", json={"model": model_name, "input": "Hi", **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_model_and_unknown_response(client, http):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="no-such-model", input="Hi")
    assert caught.value.code == "model_not_found"
    missing = http.get("/v1/responses/resp_missing")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
    assert http.delete("/v1/responses/resp_missing").status_code == 404
