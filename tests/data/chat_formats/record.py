"""Record the oracle of tests/test_chat_formats.py: real chat templates (../templates/, from
llama.cpp's models/templates) rendered by llama-cpp-python's own Jinja2 chat formatter
(``llama_cpp.llama_chat_format.Jinja2ChatFormatter``; llama.cpp's C++ Jinja path is not
exposed by llama-cpp-python) into rendered.json.

Per template: ``prompt`` (a user question with the tools, and the generation prompt),
``generation_prompt`` (what ``add_generation_prompt`` adds to it), ``history`` (the question,
the assistant's turn with reasoning and a tool call, the tool's result, and the generation
prompt) and ``turn`` (the assistant's turn as the template writes it, its header and end
markers included: the text the model generates in that format). Run with llama-cpp-python's
interpreter:

    /path/to/llamavenv/bin/python tests/data/chat_formats/record.py
"""

from __future__ import annotations

import json
from pathlib import Path

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE.parent / "templates"

# (file, bos, eos, family) of the templates whose formats the tests read
CASES = {
    "Qwen-Qwen3-0.6B": ("", "<|im_end|>"),
    "Qwen3-Coder": ("", "<|im_end|>"),
    "Qwen3.5-4B": ("", "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct": ("", "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|eot_id|>"),
    "openai-gpt-oss-120b": ("<|startoftext|>", "<|return|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>",
                                                 "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V3.1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "GLM-4.6": ("", "<|endoftext|>"),
}
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


def assistant(harmony: bool) -> dict:
    msg = {"role": "assistant", "content": "", "tool_calls": [CALL],
           "reasoning_content": REASONING}
    if harmony:  # gpt-oss's template reads `thinking`, and no content beside calls
        msg = {"role": "assistant", "tool_calls": [CALL], "thinking": REASONING}
    return msg


def render(source: str, bos: str, eos: str, messages: list[dict], gen: bool) -> str:
    formatter = Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos,
                                    add_generation_prompt=gen)
    return formatter(messages=messages, tools=TOOLS).prompt


def common(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    out = {}
    for name, (bos, eos) in CASES.items():
        source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        harmony = "<|channel|>" in source
        reply = assistant(harmony)
        bare = render(source, bos, eos, [QUESTION], False)
        prompt = render(source, bos, eos, [QUESTION], True)
        with_turn = render(source, bos, eos, [QUESTION, reply], False)
        history = render(source, bos, eos, [QUESTION, reply, RESULT], True)
        out[name] = {"bos": bos, "eos": eos, "prompt": prompt, "history": history,
                     "turn": with_turn[common(bare, with_turn):],
                     "generation_prompt": prompt[common(bare, prompt):]}
    (HERE / "rendered.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n",
                                        encoding="utf-8")
    print(f"recorded {len(out)} templates")


if __name__ == "__main__":
    main()
