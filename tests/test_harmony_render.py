"""The built-in harmony template (gpt-oss files without a usable chat template) against the
official one.

Oracle: OpenAI's gpt-oss chat template (tests/data/templates/openai-gpt-oss-120b.jinja, copied
from llama.cpp's models/templates, see the README there) rendered by plain Jinja2 the way
Hugging Face transformers' ``apply_chat_template`` sets it up. On every conversation the
built-in writes the same bytes, except for the differences it makes on purpose (stated in
localllm/chat/builtin.py), which :func:`as_builtin_writes` applies to the official text:

1. a tool call is ``<|start|>assistant<|channel|>commentary to=functions.NAME
   <|constrain|>json<|message|>ARGS<|call|>``, as the model writes it (the official template:
   ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``);
2. a tool result is written as the tool returned it (the official template JSON-quotes it).

Conversations outside what the official template renders (several calls in a turn, several
system messages, OpenAI's other effort levels) are checked on their own.

Then: the prompt written parses back with the reply parser, the selection picks the built-in
for gpt-oss files, bad input is one clear error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import pytest

import localllm.chat.template as template_module
from localllm.chat.builtin import BUILTIN_TEMPLATES, guess_builtin
from localllm.chat.harmony_tools import MAX_DEPTH, MAX_NODES, functions_namespace
from localllm.chat.replies import chat_format, parse_reply
from localllm.chat.template import ChatTemplate, select_template
from localllm.chat.tools import template_knows_tools
from localllm.errors import TemplateError

OFFICIAL = (Path(__file__).resolve().parent / "data" / "templates"
            / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
DATE = "2026-01-02"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "default": 1}},
        "required": ["city"]}}}
# Every branch of the official template's TypeScript writer, its spacing quirks included
ODD = {"type": "function", "function": {
    "name": "odd", "description": "Schemas of every shape",
    "parameters": {"type": "object", "required": ["a", "nested"], "properties": {
        "a": {"type": "string", "nullable": True},
        "tags": {"type": "array", "items": {"type": "string"}},
        "nums": {"type": "array", "items": {"type": "integer"}, "nullable": True},
        "flags": {"type": "array", "items": {"type": "boolean"}},
        "any_list": {"type": "array"},
        "points": {"type": "array", "items": {"type": "object", "properties": {
            "x": {"type": "number"}}, "required": ["x"]}},
        "wide": {"type": "array", "items": {"type": "object", "properties": {
            "first_long_name": {"type": "string"}, "second_long_name": {"type": "number"}}}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "nested": {"type": "object", "properties": {"p": {"type": "string"},
                                                   "q": {"type": "boolean"}},
                   "required": ["p"]},
        "bare_object": {"type": "object"},
        "either": {"oneOf": [{"type": "string", "description": "a name"},
                             {"type": "number", "default": 2}], "default": "x"},
        "shapes": {"oneOf": [{"type": "object", "properties": {"r": {"type": "number"}}},
                             {"type": "object"}]},
        "union": {"type": ["string", "number"]},
        "single": {"type": ["boolean"]},
        "ref": {"$ref": "#/definitions/x"},
        "anything": True,
        "flag": {"type": "boolean", "default": False, "description": "a flag"},
        "ratio": {"type": "number", "default": 0.5},
        "mode": {"type": "string", "enum": ["a", "b"]},
    }}}}
NO_ARGS = {"type": "function", "function": {"name": "now", "description": "The time",
                                            "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
THINK = "The user wants the weather. I should call get_weather."
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny"}'}
ANSWER = {"role": "assistant", "content": "It is 21 C and sunny.", "thinking": "Read it."}

# name -> (messages, tools, add_generation_prompt, template variables)
CONVERSATIONS = {
    "plain": ([USER], None, True, {}),
    "system": ([{"role": "system", "content": "Answer in French."}, USER], None, True, {}),
    "developer": ([{"role": "developer", "content": "Be brief."}, USER], None, True, {}),
    "effort-low": ([USER], None, True, {"reasoning_effort": "low"}),
    "effort-high-identity": ([USER], None, True, {"reasoning_effort": "high",
                                                  "model_identity": "You are a helper."}),
    "tools": ([{"role": "system", "content": "Use tools."}, USER], [WEATHER, ODD, NO_ARGS],
              True, {}),
    "multi-turn": ([USER, {"role": "assistant", "content": "Sunny.", "thinking": "Easy."},
                    {"role": "user", "content": "And tomorrow?"}], None, True, {}),
    "last-turn-kept": ([USER, ANSWER], None, False, {}),
    "tool-call-pending": ([USER, {"role": "assistant", "tool_calls": [CALL],
                                  "thinking": THINK}, RESULT], [WEATHER], True, {}),
    "tool-call-answered": ([USER, {"role": "assistant", "tool_calls": [CALL],
                                   "thinking": THINK}, RESULT, ANSWER,
                            {"role": "user", "content": "Thanks"}], [WEATHER], True, {}),
    "preamble-as-analysis": ([USER, {"role": "assistant", "content": "Let me look.",
                                     "tool_calls": [CALL]}, RESULT], [WEATHER], True, {}),
}


def fixed_date(fmt: str) -> str:
    assert fmt == "%Y-%m-%d"
    return DATE


def official_render(messages, tools, add_generation_prompt, variables) -> str:
    """The oracle: the official template in plain Jinja2, set up as transformers does."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                               indent=indent)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals.update(raise_exception=raise_exception, strftime_now=fixed_date)
    return env.from_string(OFFICIAL).render(messages=messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt,
                                            **variables)


@pytest.fixture(scope="module")
def builtin() -> ChatTemplate:
    """The built-in, compiled once, with its clock fixed at :data:`DATE`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(template_module, "_strftime_now", fixed_date)
        return ChatTemplate("harmony (built-in)", BUILTIN_TEMPLATES["harmony"])


def as_builtin_writes(official: str) -> str:
    """The official template's text with the built-in's two stated differences applied."""
    text = re.sub(r"<\|start\|>assistant to=functions\.([\w.-]+)<\|channel\|>commentary "
                  r"(\w+)<\|message\|>",
                  r"<|start|>assistant<|channel|>commentary to=functions.\1 <|constrain|>\2"
                  r"<|message|>", official)
    return re.sub(r"( to=assistant<\|channel\|>commentary<\|message\|>)(.*?)(<\|end\|>)",
                  lambda m: m[1] + json.loads(m[2]) + m[3], text, flags=re.DOTALL)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_builtin_writes_what_the_official_template_writes(builtin, name):
    messages, tools, gen, variables = CONVERSATIONS[name]
    official = official_render(messages, tools, gen, variables)
    ours = builtin.render(messages, gen, tools, **variables)
    has_calls = any(m.get("tool_calls") for m in messages)
    if has_calls:  # the stated differences are real here, and the only ones
        assert ours != official
        assert ours == as_builtin_writes(official)
    else:
        assert ours == official
    assert f"Current date: {DATE}\n" in ours


def test_tool_declarations_byte_for_byte():
    # The namespace alone, for the schemas of every branch (and the cookbook's shape)
    official = official_render([USER], [WEATHER, ODD, NO_ARGS], True, {})
    ours = functions_namespace([WEATHER, ODD, NO_ARGS])
    assert ours in official
    assert ('// City name\ncity: string,\nunit?: "celsius" | "fahrenheit", // default: celsius,'
            '\ndays?: number, // default: 1,\n}) => any;') in ours
    assert "type now = () => any;" in ours


def test_reasoning_effort_and_thinking_switch(builtin):
    def effort(**variables):
        return re.search(r"Reasoning: (\w+)", builtin.render([USER], True, None,
                                                             **variables))[1]

    assert effort() == "medium"
    assert effort(reasoning_effort="HIGH") == "high"
    # OpenAI's other levels, and thinking switched off, map onto harmony's three
    assert effort(reasoning_effort="minimal") == "low"
    assert effort(reasoning_effort="xhigh") == "high"
    assert effort(enable_thinking=False) == "low"
    assert effort(enable_thinking=False, reasoning_effort="high") == "high"


def test_every_system_and_developer_message_is_kept(builtin):
    # The official template keeps the first and drops the rest: the leading ones are the
    # instructions together (Responses' `instructions` beside developer items), a later one
    # a developer message in its place
    text = builtin.render([{"role": "system", "content": "Be brief."},
                           {"role": "developer", "content": "Use metric units."}, USER,
                           {"role": "assistant", "content": "Sunny."},
                           {"role": "system", "content": "Now answer in French."},
                           {"role": "user", "content": "Demain ?"}], True, None)
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\nUse metric units."
            "\n\n<|end|><|start|>user<|message|>") in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
                         "<|start|>developer<|message|>Now answer in French.<|end|>"
                         "<|start|>user<|message|>Demain ?<|end|><|start|>assistant")


def test_parallel_calls_and_results_by_id(builtin):
    # The official template writes only the first call; harmony writes one message each, and
    # each result goes under the name of the call its tool_call_id names
    second = {"id": "call_2", "type": "function",
              "function": {"name": "now", "arguments": '{"zone": "CET"}'}}
    text = builtin.render([USER, {"role": "assistant", "tool_calls": [CALL, second]},
                           {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                          True, [WEATHER, NO_ARGS])
    assert text.endswith(
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris", "days": 2}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.now <|constrain|>json'
        '<|message|>{"zone": "CET"}<|call|>'  # arguments given as JSON text: as they are
        '<|start|>functions.now to=assistant<|channel|>commentary<|message|>12:00<|end|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny'
        '<|end|><|start|>assistant')
    assert builtin.render([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "now"}}]}], False, [NO_ARGS]).endswith(
        "to=functions.now <|constrain|>json<|message|>{}<|call|>")  # no arguments: {}
    # without ids, results follow the calls' order
    text = builtin.render([USER, {"role": "assistant", "tool_calls": [CALL, second]},
                           {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}],
                          True, [WEATHER, NO_ARGS])
    assert "functions.get_weather to=assistant<|channel|>commentary<|message|>a" in text
    assert "functions.now to=assistant<|channel|>commentary<|message|>b" in text


def test_format_and_tools_read_from_the_builtin():
    source = BUILTIN_TEMPLATES["harmony"]
    fmt = chat_format(source)
    assert fmt.harmony and fmt.tool_syntax == "harmony"
    assert template_knows_tools(source)


def _reply(builtin: ChatTemplate, turn: dict) -> str:
    """What the model writes for ``turn``: the built-in's text of it after the prompt's
    ``<|start|>assistant``, up to its end-of-generation token."""
    prompt = builtin.render([USER], True, [WEATHER])
    whole = builtin.render([USER, turn], False, [WEATHER])
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    for end in ("<|return|>", "<|call|>"):
        text = text.removesuffix(end)
    return text


def test_rendered_turns_parse_back(builtin):
    fmt = chat_format(builtin.source)
    answer = parse_reply(_reply(builtin, ANSWER), fmt, tools=[WEATHER])
    assert (answer.reasoning, answer.content, answer.calls) == (
        "Read it.", "It is 21 C and sunny.", [])
    # the tool call as the built-in writes it in history is what the parser reads as a call
    call_turn = {"role": "assistant", "tool_calls": [CALL], "thinking": THINK}
    message = parse_reply(_reply(builtin, call_turn), fmt, tools=[WEATHER])
    assert message.reasoning == THINK and not message.content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.calls] == [("get_weather", {"city": "Paris", "days": 2})]


@pytest.mark.parametrize("metadata", [
    {"general.architecture": "gpt-oss"},
    {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "<|channel|>", "b"]},
])
def test_gpt_oss_files_get_the_builtin(metadata):
    assert guess_builtin(metadata) == "harmony"
    assert select_template(metadata).name == "harmony (built-in)"
    assert select_template({}, "harmony").name == "harmony (built-in)"


def test_a_template_that_does_not_compile_falls_back_only_for_harmony(caplog):
    broken = "{% for %}"
    chosen = select_template({"general.architecture": "gpt-oss",
                              "tokenizer.chat_template": broken})
    assert chosen.name == "harmony (built-in)"
    assert "using the built-in harmony" in caplog.text
    with pytest.raises(TemplateError, match="syntax error"):
        select_template({"general.architecture": "qwen2", "tokenizer.chat_template": broken})


def _tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "description": "d",
                                              "parameters": parameters}}]


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


_CYCLIC: dict = {"type": "object", "properties": {}}
_CYCLIC["properties"]["self"] = _CYCLIC
_WIDE = {"type": "object", "properties": {
    f"p{i}": {"type": "array", "items": {"type": "object", "properties": {
        "q": {"type": "string"}}}} for i in range(MAX_NODES // 3 + 1)}}


@pytest.mark.parametrize(("messages", "tools", "variables", "named"), [
    ([USER], _tool(_CYCLIC), {}, "nested more than 64 levels deep (or cyclic)"),
    ([USER], _tool(_deep(MAX_DEPTH + 1)), {}, "tools[0] (f).parameters.properties.a"),
    ([USER], _tool(_WIDE), {}, f"more than {MAX_NODES} schemas"),
    ([USER], _tool({"type": "object", "properties": ["a"]}), {}, "properties: must be an object"),
    ([USER], _tool({"type": "object", "properties": {"a": {"type": "string"}},
                    "required": "a"}), {}, "required: must be a list"),
    ([USER], _tool({"type": "object", "properties": {"a": {"type": "string",
                                                          "default": {1}}}}), {},
     "default is not JSON"),
    ([USER], _tool("object"), {}, "parameters: must be a JSON schema object"),
    ([USER], [{"type": "function"}], {}, "tools[0]: must be"),
    ([USER], [{"type": "function", "function": {"name": "f", "description": 3}}], {},
     "description: must be text"),
    ([USER], None, {"reasoning_effort": "extreme"}, "reasoning_effort must be low, medium"),
    ([USER, {"role": "ipython", "content": "x"}], None, {}, "harmony has no ipython role"),
    ([USER, RESULT], None, {}, "message 1: a tool result with no assistant tool call"),
    ([USER, {"role": "assistant", "content": "<|channel|>final<|message|>hi"}], None, {},
     "holds harmony channel markers"),
    ([USER, {"role": "assistant", "content": "a", "thinking": "b", "tool_calls": [CALL]}],
     None, {}, "both content and reasoning"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], None, {},
     "a tool call without a name"),
])
def test_bad_input_is_one_clear_error(builtin, messages, tools, variables, named):
    with pytest.raises(TemplateError) as e:
        builtin.render(messages, True, tools, **variables)
    assert named in str(e.value) and "harmony" in str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


# ---- through the server and the official openai client ------------------------------------
@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory) -> Path:
    """The small random gpt-oss of the family fixtures (harmony's tokens, no chat template in
    the file), with a context its byte-sized tokens fit in."""
    import dataclasses

    from families import FAMILIES, SEED

    from localllm.models.synthetic import write_synthetic

    geometry, quant = FAMILIES["gpt-oss"]
    return write_synthetic(tmp_path_factory.mktemp("harmony") / "gpt-oss.gguf",
                           dataclasses.replace(geometry, name="tiny-gpt-oss",
                                               context_length=4096), quant, seed=SEED)


def test_render_chat_gives_the_reasoning_as_the_official_template_reads_it(gpt_oss_file):
    # A tool-call turn sent back with content and reasoning_content: the official template
    # raises on both, so the reasoning becomes `thinking` and the content goes, as llama.cpp
    # does; the GGUF's official template and the built-in then write the same conversation
    from localllm import LLM
    from localllm.api.chat import render_chat

    llm = LLM(str(gpt_oss_file), ctx_size=4096, device="cpu")
    sent = [USER, {"role": "assistant", "content": "Let me check.", "reasoning_content": THINK,
                   "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                        "arguments": '{"city": "Paris", "days": 2}'}}]},
            RESULT]
    read = [USER, {"role": "assistant", "thinking": THINK, "tool_calls": [CALL]}, RESULT]
    official = official_render(read, [WEATHER], True, {})

    def dated(text: str) -> str:
        return re.sub(r"Current date: \d{4}-\d\d-\d\d", f"Current date: {DATE}", text)

    assert dated(render_chat(llm, sent, template=OFFICIAL, tools=[WEATHER]).text) == official
    prompt = render_chat(llm, sent, tools=[WEATHER])
    assert prompt.template_name == "harmony (built-in)" and prompt.fmt.harmony
    assert dated(prompt.text) == as_builtin_writes(official)


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_file):
    """``localllm serve`` on it."""
    from test_server import KEY, Server

    server = Server(gpt_oss_file, "--api-key", KEY, "-c", "4096")
    yield server
    server.stop()


def test_tool_round_trip_through_the_server(gpt_oss):
    from test_server_agents import raw

    status, _, props = raw(gpt_oss, "GET", "/props")
    assert status == 200 and props["chat_template"] == BUILTIN_TEMPLATES["harmony"]
    assert props["chat_format"]["harmony"]
    # 1. a forced call (an enum keeps the random model's arguments short), read back by the
    # harmony parser from what the model wrote after the built-in's prompt
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lyon"]}},
            "required": ["city"], "additionalProperties": False}}}
    system = {"role": "developer", "content": "Be brief."}
    client = gpt_oss.client()
    first = client.chat.completions.create(
        model="gpt-oss", messages=[system, USER], tools=[tool], temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        reasoning_effort="high", extra_body={"reasoning_budget_tokens": 0})
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Lyon")
    # 2. the call sent back as the openai client sends it (arguments as JSON text, no
    # content) with the turn's reasoning and the tool's result
    turn = {**first.choices[0].message.model_dump(exclude_none=True),
            "reasoning_content": THINK}
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}
    second = client.chat.completions.create(
        model="gpt-oss", messages=[system, USER, turn, result], tools=[tool], max_tokens=1,
        reasoning_effort="high")
    # the prompt the server ran is the built-in's text of that conversation (written here
    # in the template's own shape), counted by the server's tokenizer
    expected = ChatTemplate("harmony", BUILTIN_TEMPLATES["harmony"]).render(
        [{"role": "system", "content": "Be brief."}, USER,
         {"role": "assistant", "thinking": THINK, "tool_calls": [
             {"id": call.id, "function": {"name": "get_weather", "arguments": args}}]},
         result], True, [tool], reasoning_effort="high")
    assert "Reasoning: high" in expected and expected.endswith(
        f"<|start|>assistant<|channel|>analysis<|message|>{THINK}<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{json.dumps(args)}<|call|><|start|>functions.get_weather to=assistant"
        '<|channel|>commentary<|message|>{"temp": 21}<|end|><|start|>assistant')
    status, _, tokens = raw(gpt_oss, "POST", "/tokenize",
                            {"content": expected, "add_special": True, "parse_special": True})
    assert status == 200 and second.usage.prompt_tokens == len(tokens["tokens"])


@pytest.mark.parametrize(("extra", "named"), [
    ({"chat_template_kwargs": {"reasoning_effort": "extreme"}}, "reasoning_effort must be"),
    ({"messages": [USER, {"role": "function", "content": "x"}]}, "harmony has no function role"),
    ({"messages": [USER, RESULT]}, "a tool result with no assistant tool call"),
    ({"messages": [USER, {"role": "assistant", "content": "<|channel|>final<|message|>x"}]},
     "harmony channel markers"),
])
def test_server_bad_conversations_are_400(gpt_oss, extra, named):
    from test_server_agents import raw

    status, _, reply = raw(gpt_oss, "POST", "/v1/chat/completions",
                           {"model": "gpt-oss", "messages": [USER], "max_tokens": 1, **extra})
    assert status == 400 and named in reply["error"]["message"], reply
    status, _, _ = raw(gpt_oss, "POST", "/v1/chat/completions",
                       {"model": "gpt-oss", "messages": [USER], "max_tokens": 1})
    assert status == 200  # still serving


def test_cli_bad_effort_is_one_error_line(gpt_oss_file, monkeypatch, capsys):
    from cli_helpers import assert_one_line_error, run_cli

    code, _, err = run_cli(monkeypatch, capsys, "run", str(gpt_oss_file), "hi", "--chat",
                           "-n", "1", "--chat-template-kwargs", '{"reasoning_effort": "max"}')
    assert_one_line_error(code, err, "reasoning_effort must be low, medium or high, not max")
