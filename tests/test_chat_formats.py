"""Reasoning and tool calls in every family's format, against the families' real chat
templates (tests/data/templates, from llama.cpp's models/templates) rendered by
llama-cpp-python's Jinja2 chat formatter (tests/data/chat_formats/record.py).

* our sandboxed renderer writes the same prompts as llama-cpp-python's (the oracle);
* the assistant turn the template itself writes (reasoning and a tool call, as the model
  generates it) parses back into the same reasoning and call, whatever the pieces the text
  streams in; the streamed argument pieces add up to the arguments;
* the lazy grammar of ``tool_choice="auto"`` accepts that turn's call, and only after its
  trigger.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import localllm.chat.template as template_module
from localllm.chat.events import ReplyMessage
from localllm.chat.reasoning import generation_prompt, opens_thinking
from localllm.chat.replies import ReplyParser, chat_format
from localllm.chat.template import ChatTemplate

DATA = Path(__file__).resolve().parent / "data"
RENDERED = json.loads((DATA / "chat_formats" / "rendered.json").read_text(encoding="utf-8"))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
REASONING = "The user wants the weather in Paris. I should call get_weather."
CALL = {"id": "a1b2c3d4e", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
RESULT = {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather",
          "content": "21 C, sunny"}
# (reasoning markers, tool-call syntax, the turn carries its reasoning) per template
FAMILIES = {
    "Qwen-Qwen3-0.6B": ("<think>", "hermes", True),
    "Qwen3-Coder": (None, "qwen-xml", False),
    "Qwen3.5-4B": ("<think>", "qwen-xml", True),
    "Qwen-Qwen2.5-7B-Instruct": (None, "hermes", False),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (None, "hermes", False),
    "openai-gpt-oss-120b": ("<|channel|>analysis<|message|>", "harmony", True),
    "meta-llama-Llama-3.1-8B-Instruct": (None, "llama3", False),
    "meta-llama-Llama-3.2-3B-Instruct": (None, "llama3", False),
    "mistralai-Mistral-Nemo-Instruct-2407": (None, "mistral", False),
    "Mistral-Small-3.2-24B-Instruct-2506": (None, "mistral-args", False),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<think>", "deepseek-r1", False),
    "deepseek-ai-DeepSeek-V3.1": ("<think>", "deepseek-v3", False),
    "GLM-4.6": ("<think>", "glm", True),
}
# Where a template's history turn does not begin with its own generation prompt (DeepSeek R1's
# adds a closed thinking block there that its history drops), the header to take off.
HEADERS = {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "<｜Assistant｜>"}
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|call|>", "<|return|>", "</s>", "<|endoftext|>",
               "<｜end▁of▁sentence｜>")


def source(name: str) -> str:
    return (DATA / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def assistant(harmony: bool) -> dict:
    if harmony:
        return {"role": "assistant", "tool_calls": [CALL], "thinking": REASONING}
    return {"role": "assistant", "content": "", "tool_calls": [CALL],
            "reasoning_content": REASONING}


def reply_text(name: str) -> tuple[str, bool]:
    """The recorded turn as the model writes it (header and end markers off), and whether
    it begins inside a thinking block."""
    case = RENDERED[name]
    turn, header = case["turn"], HEADERS.get(name, case["generation_prompt"])
    assert turn.startswith(header), (turn[:80], header)
    text = turn[len(header):]
    cut = min((text.find(m) for m in END_MARKERS if m in text), default=len(text))
    fmt = chat_format(source(name))
    inside = fmt.thinking is not None and not fmt.harmony and opens_thinking(
        header, fmt.thinking)
    return text[:cut], inside


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_rendering_matches_llama_cpp_python(name, monkeypatch):
    case = RENDERED[name]
    recorded = re.search(r"Current date: (\d{4}-\d\d-\d\d)", case["prompt"])
    if recorded:  # gpt-oss's template writes the day: the day it was recorded
        monkeypatch.setattr(template_module, "_strftime_now", lambda fmt: recorded[1])
    template = ChatTemplate(name, source(name), case["bos"], case["eos"])
    harmony = "<|channel|>" in template.source
    assert template.render([QUESTION], True, TOOLS) == case["prompt"]
    assert template.render([QUESTION, assistant(harmony), RESULT], True, TOOLS) == \
        case["history"]
    bare = template.render([QUESTION], False, TOOLS)
    assert generation_prompt(case["prompt"], bare) == case["generation_prompt"]


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_format_detected_from_the_template(name):
    start, syntax, _ = FAMILIES[name]
    fmt = chat_format(source(name))
    assert (fmt.thinking.start if fmt.thinking else None) == start
    assert fmt.tool_syntax == syntax
    assert fmt.harmony == (syntax == "harmony")


@pytest.mark.parametrize("chunk", [1, 3, 7, 10_000])
@pytest.mark.parametrize("name", sorted(RENDERED))
def test_the_templates_own_turn_parses_back(name, chunk):
    text, inside = reply_text(name)
    parser = ReplyParser(chat_format(source(name)), inside=inside, tools=TOOLS)
    message, pieces = ReplyMessage(), []
    for i in range(0, len(text), chunk):
        for event in parser.push(text[i:i + chunk]):
            message.add(event)
            if event.kind == "arguments":
                pieces.append(event.text)
    for event in parser.finish():
        message.add(event)
    assert message.content.strip() == ""
    assert message.reasoning == (REASONING if FAMILIES[name][2] else "")
    (call,) = message.calls
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert "".join(pieces) == call["function"]["arguments"] == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_no_reasoning_format_leaves_the_text_in_content(name):
    text, inside = reply_text(name)
    message = ReplyMessage()
    parser = ReplyParser(chat_format(source(name)), reasoning=False, inside=inside)
    for event in [*parser.push(text), *parser.finish()]:
        message.add(event)
    assert message.reasoning == "" and not message.calls
    if FAMILIES[name][2] and not chat_format(source(name)).harmony:
        assert REASONING in message.content


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiny_model import QWEN3_SPECIALS, write_tiny_gguf

    from localllm.gguf.file import open_gguf
    from localllm.tokenizer import Tokenizer

    path = write_tiny_gguf(tmp_path_factory.mktemp("fmt") / "q3.gguf", "qwen3",
                           specials=QWEN3_SPECIALS)
    return Tokenizer(open_gguf(path).metadata)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_lazy_grammar_takes_the_templates_call(name, tokenizer):
    from localllm.grammar.toolcalls import tool_call_constraint

    text, _ = reply_text(name)
    fmt = chat_format(source(name))
    lazy = tool_call_constraint(tokenizer, TOOLS, fmt.tool_syntax)
    ids = tokenizer.encode(text, add_bos=False, special=True)
    for i, token in enumerate(ids):
        assert lazy.is_allowed(token), (name, tokenizer.decode(ids[:i + 1], special=True))
        lazy.accept(token)
    assert lazy.active and lazy.is_accepting()
    # Before its trigger it constrains nothing: a stray token of any kind is allowed.
    fresh = tool_call_constraint(tokenizer, TOOLS, fmt.tool_syntax)
    assert all(fresh.is_allowed(t) for t in range(tokenizer.n_vocab))


def test_lazy_grammar_refuses_a_wrong_argument_after_the_trigger(tokenizer):
    from localllm.grammar.toolcalls import tool_call_constraint

    lazy = tool_call_constraint(tokenizer, TOOLS, "hermes")
    good = tokenizer.encode('Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
                            '{"city": "Paris", "days": 3}}\n</tool_call>', add_bos=False,
                            special=True)
    bad = tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"town"',
                           add_bos=False, special=True)
    for token in good:
        assert lazy.is_allowed(token)
        lazy.accept(token)
    assert lazy.is_accepting()
    lazy.reset()
    refused = False
    for token in bad:
        if not lazy.is_allowed(token):
            refused = True
            break
        lazy.accept(token)
    assert refused and lazy.active


# Two calls in one reply, in each family's own syntax (as the templates above write one call).
TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Rome", "days": 2}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}},'
               ' {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
    "qwen-xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>"
                "\n2\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("syntax", sorted(TWO_CALLS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_parallel_calls_stream_with_stable_ids(syntax, step):
    from localllm.chat.toolparse import ToolScanner

    text = TWO_CALLS[syntax]
    scanner = ToolScanner(TOOLS)
    events = []
    for i in range(0, len(text), step):
        events += scanner.push(text[i:i + step])
    events += scanner.finish()
    opened = [e for e in events if e.kind == "call"]
    assert [e.index for e in opened] == [0, 1] and len({e.id for e in opened}) == 2
    args = {i: "".join(e.text for e in events if e.kind == "arguments" and e.index == i)
            for i in (0, 1)}
    assert [json.loads(args[i]) for i in (0, 1)] == [{"city": "Paris", "days": 1},
                                                      {"city": "Rome", "days": 2}]
    # parallel_tool_calls=false: the second call is not a call (its text is content); a
    # Mistral array is one unit, left whole as content (its lazy grammar then allows one
    # element, so a model cannot write the second)
    single = ToolScanner(TOOLS, parallel=False)
    message = ReplyMessage()
    for event in [*single.push(text), *single.finish()]:
        message.add(event)
    assert len(message.calls) == (0 if syntax == "mistral" else 1)
    assert "Rome" in message.content
