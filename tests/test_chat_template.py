"""Chat templates (localllm.chat.template): rendering, built-ins, selection, sandbox."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from localllm.chat.builtin import BUILTIN_TEMPLATES, guess_builtin
from localllm.chat.template import ChatTemplate, apply_chat, select_template, template_for
from localllm.errors import TemplateError

DATA = Path(__file__).parent / "data" / "chat"

SPM_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def metadata(extra_tokens=(), arch="llama", model="llama", **kw):
    md = {
        "general.architecture": arch,
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": SPM_TOKENS + list(extra_tokens),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
    }
    md.update(kw)
    return md


def from_file(name: str, bos="<s>", eos="</s>") -> ChatTemplate:
    return ChatTemplate(name, (DATA / name).read_text(), bos, eos)


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
TOOL_CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}},
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
    {"role": "tool", "content": "4"},
    {"role": "tool", "content": "2"},
]


# ---- our own templates modelled on real families -----------------------------------------
def test_qwen_like_with_tools_and_generation_prompt():
    t = from_file("qwen_like.jinja")
    out = t.render(TOOL_CONV, tools=TOOLS)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
        + json.dumps(TOOLS[0]) + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 2}}"
        "\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 1}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = t.render(CONV, add_generation_prompt=False)
    assert plain == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    )


def test_llama3_like_bos_date_and_alternation():
    t = from_file("llama3_like.jinja", bos="<|begin_of_text|>")
    out = t.render(CONV, date_string="26 Jul 2024")
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert t.starts_with_bos(out)
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}\n\n" in t.render(CONV[1:2])  # strftime_now
    with pytest.raises(TemplateError, match="raised: Conversation roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma_like_folds_system_and_reads_parts():
    t = from_file("gemma_like.jinja", bos="<bos>")
    conv = [*CONV[:3], {"role": "user", "content": [{"type": "text", "text": " 2+2? "}]}]
    assert t.render(conv) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )


# ---- built-in fallbacks --------------------------------------------------------------------
def builtin(name: str, bos: str, eos: str) -> ChatTemplate:
    return ChatTemplate(name, BUILTIN_TEMPLATES[name], bos, eos)


EXPECTED_BUILTIN = {
    "gemma": ("<bos>", "<eos>",
              ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
              "Hello!<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n"
              "<start_of_turn>model\n")),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>",
               ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")),
    "chatml": ("", "<|im_end|>",
               ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
               "<|im_start|>assistant\n")),
    "mistral": ("<s>", "</s>", "<s>[INST] Be brief.\n\nHi [/INST] Hello!</s>[INST] 2+2? [/INST]"),
    "llama2": ("<s>", "</s>",
               ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
               "<s>[INST] 2+2? [/INST]")),
    "phi3": ("<s>", "<|endoftext|>",
             ("<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
             "<|user|>\n2+2?<|end|>\n<|assistant|>\n")),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BUILTIN))
def test_builtin_templates(name):
    bos, eos, expected = EXPECTED_BUILTIN[name]
    assert builtin(name, bos, eos).render(CONV) == expected


def test_builtin_chatml_tool_calls():
    out = builtin("chatml", "", "<|im_end|>").render(TOOL_CONV, tools=TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in out
    assert ("<|im_start|>assistant\n<tool_call>\n"
            '{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>') in out
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n")


def test_builtin_gemma_without_system_and_without_generation_prompt():
    t = builtin("gemma", "<bos>", "<eos>")
    assert t.render(CONV[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n")


def test_guess_builtin_from_vocabulary_and_architecture():
    assert guess_builtin(metadata(["<start_of_turn>", "<end_of_turn>"], arch="gemma3")) == "gemma"
    assert guess_builtin(metadata(arch="gemma3")) == "gemma"  # no markers: by architecture
    assert guess_builtin(metadata(["<|start_header_id|>"], model="gpt2")) == "llama3"
    assert guess_builtin(metadata(["<|im_start|>", "<|im_end|>"], arch="qwen2")) == "chatml"
    assert guess_builtin(metadata(arch="qwen3", model="gpt2")) == "chatml"
    assert guess_builtin(metadata(["<|assistant|>", "<|end|>"], arch="phi3")) == "phi3"
    assert guess_builtin(metadata(["[INST]", "[/INST]"])) == "mistral"
    assert guess_builtin(metadata()) == "llama2"
    assert guess_builtin(metadata(arch="llama", model="gpt2")) == "llama3"
    assert guess_builtin(metadata(arch="unknownarch", model="gpt2")) == "chatml"


# ---- selection -----------------------------------------------------------------------------
def test_select_prefers_metadata_then_builtin():
    md = metadata(["<start_of_turn>"], arch="gemma3")
    t = select_template(md)
    assert t.name == "gemma (built-in)" and t.bos_token == "<bos>" and t.eos_token == "<eos>"
    md["tokenizer.chat_template"] = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    md["tokenizer.chat_template.rag"] = "RAG{{ messages | length }}"
    t = select_template(md)
    assert t.name == "tokenizer.chat_template"
    assert t.render(CONV) == "<bos>[Be brief.][Hi][Hello!][2+2?]"
    assert select_template(md, "rag").render(CONV) == "RAG4"
    assert select_template(md, "chatml").name == "chatml (built-in)"
    assert select_template(md, "{{ messages[0].role }}").render(CONV) == "system"


def test_select_file_and_missing_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.role }};{% endfor %}")
    assert select_template(metadata(), str(f), files=True).render(CONV) == \
        "system;user;assistant;user;"
    with pytest.raises(TemplateError, match=r"--chat-template .*nope\.jinja: no such file"):
        select_template(metadata(), str(tmp_path / "nope.jinja"), files=True)


def test_paths_are_not_templates_without_files(tmp_path):
    """Text from the API or a client is never taken for a path: an existing file and a
    missing one give the same error, and nothing of the file is read (issue #26 item 1)."""
    f = tmp_path / "secret.jinja"
    f.write_text("{{ 'SECRET' }}")
    errors = []
    for path in (str(f), str(tmp_path / "missing.jinja"), "/etc/passwd", "/proc/self/environ"):
        with pytest.raises(TemplateError) as e:
            select_template(metadata(), path)
        errors.append(re.sub(r"^chat template '[^']*'", "", str(e.value)))
        assert "SECRET" not in str(e.value) and "no such file" not in str(e.value)
    assert len(set(errors)) == 1, errors


@pytest.mark.parametrize("kind", ["fifo", "dir", "big", "binary"])
def test_template_files_are_regular_bounded_text(tmp_path, kind):
    import os

    from localllm.chat.template import MAX_TEMPLATE_CHARS

    path = tmp_path / "t"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer for ever
    elif kind == "dir":
        path.mkdir()
    elif kind == "big":
        with open(path, "wb") as f:  # sparse: 2.5 GB that are never read
            f.truncate(2_500_000_000)
    else:
        path.write_bytes(b"{{ 1 }}\xff\xfe")
    message = {"fifo": "not a regular file", "dir": "not a regular file",
               "big": f"larger than the limit of {MAX_TEMPLATE_CHARS}", "binary": "not UTF-8"}
    with pytest.raises(TemplateError, match=message[kind]):
        select_template(metadata(), str(path), files=True)


def test_compiled_templates_are_a_bounded_cache():
    from localllm.chat.template import MAX_CACHED_TEMPLATES, compiled

    compiled.cache_clear()
    for i in range(MAX_CACHED_TEMPLATES * 3):
        select_template(metadata(), f"{{{{ 'x{i}' }}}}")
    info = compiled.cache_info()
    assert info.currsize == MAX_CACHED_TEMPLATES and info.misses == MAX_CACHED_TEMPLATES * 3
    first = select_template(metadata(), "{{ 'again' }}")
    assert select_template(metadata(), "{{ 'again' }}") is first  # compiled once


def test_models_toml_entry_and_cli_override():
    llm = SimpleNamespace(metadata=metadata(["<|im_start|>"]), entry=SimpleNamespace(chat_template="gemma"))
    assert template_for(llm).name == "gemma (built-in)"
    assert template_for(llm, "phi3").name == "phi3 (built-in)"
    llm.entry = None
    assert template_for(llm).name == "chatml (built-in)"


class FakeTokenizer:
    add_bos = True

    def __init__(self):
        self.calls = []

    def encode(self, text, *, add_bos=None, special=False):
        self.calls.append((text, add_bos, special))
        return [ord(c) for c in text][:3]


def test_no_double_bos_and_special_parsing():
    tok = FakeTokenizer()
    with_bos = builtin("gemma", "<bos>", "<eos>")
    with_bos.encode(tok, CONV[1:2])
    assert tok.calls[-1][1:] == (False, True)  # template wrote BOS: tokenizer must not
    builtin("chatml", "<s>", "</s>").encode(tok, CONV[1:2])
    assert tok.calls[-1][1:] == (True, True)


def test_apply_chat_one_shot():
    tok = FakeTokenizer()
    llm = SimpleNamespace(metadata=metadata(["<start_of_turn>"], arch="gemma3"), entry=None,
                          tokenizer=tok)
    apply_chat(llm, "Hi", system="Be brief.")
    text, add_bos, special = tok.calls[-1]
    assert text == EXPECTED_BUILTIN["gemma"][2].split("<start_of_turn>model\nHello!")[0].replace(
        "<end_of_turn>\n", "<end_of_turn>\n<start_of_turn>model\n")
    assert (add_bos, special) == (False, True)


# ---- transformers-compatible environment ---------------------------------------------------
def render(source: str, **kw) -> str:
    return ChatTemplate("test", source, "<s>", "</s>").render(CONV, **kw)


def test_tojson_like_transformers():
    data = [{"text": "héllo <b>&</b>", "n": 1}]
    assert render("{{ x | tojson }}", x=data) == '[{"text": "héllo <b>&</b>", "n": 1}]'
    assert render("{{ x | tojson(indent=2) }}", x={"a": 1}) == '{\n  "a": 1\n}'
    assert render("{{ x | tojson(separators=(',', ':')) }}", x={"a": [1, 2]}) == '{"a":[1,2]}'
    assert render("{{ x | tojson(ensure_ascii=True) }}", x="é") == '"\\u00e9"'


def test_loop_controls_trim_blocks_and_generation_tag():
    src = ("{% for m in messages %}\n{% if loop.index0 == 1 %}{% continue %}{% endif %}\n"
           "{% if m.role == 'assistant' %}{% break %}{% endif %}\n{{ m.role }},\n{% endfor %}")
    assert render(src) == "system,\n"
    assert render("{% generation %}x{{ eos_token }}{% endgeneration %}") == "x</s>"


def test_namespace_works():
    src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert render(src) == "4"


# ---- sandbox -------------------------------------------------------------------------------
PAYLOADS = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace() %}{{ ns.__dict__ }}",
    "{{ self.__dict__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ messages|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ '{0.__class__}'.format_map({}) }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ raise_exception.__globals__ }}",
    "{{ 'a' * 10**9 }}",
    "{{ [1] * 10**9 }}",
    "{{ 10 ** (10 ** 7) }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '%*s' % (99999999, 'x') }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ 'x' | indent(1000000000) }}",
    "{{ '%999999999s' | format('x') }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{{ raise_exception('boom\nsecond line') }}",
    "{% if %}",
    "{{ 1 / 0 }}",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_sandbox_refuses(payload):
    with pytest.raises(TemplateError) as e:
        ChatTemplate("evil", payload, "<s>", "</s>", time_limit=1.0).render(CONV)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("chat template evil")


# Values that double themselves: before weighing, str()/tojson/== expanded 2**40 leaves in C
# and never returned.
_DOUBLING = "{% set a = ['x'] %}" + "{% set a = [a, a] %}" * 40
SHARED_VALUE_BOMBS = [
    _DOUBLING + "{{ a }}",
    _DOUBLING + "{{ a | tojson }}",
    "{% set a = ['x'] %}{% set b = ['x'] %}" + "{% set a = [a, a] %}{% set b = [b, b] %}" * 40
    + "{{ a == b }}",
    ("{% set s = namespace(v='x') %}{% for i in range(40) %}"
    "{% set s.v = {'k': s.v, 'j': s.v} %}{% endfor %}{{ s.v | tojson }}"),
    ("{% set s = namespace(v='x') %}{% for i in range(40) %}"
    "{% set s.v = [s.v] | batch(2, s.v) | list %}{% endfor %}{{ s.v }}"),
    ("{% macro f(n, x) %}{% if n %}{{ f(n - 1, (x, x)) }}{% else %}{{ x }}{% endif %}"
    "{% endmacro %}{{ f(40, 'x') }}"),
    # No runtime hook sees `set ns.attr`: refused when compiling.
    "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}{{ ns }}",
]


@pytest.mark.parametrize("payload", SHARED_VALUE_BOMBS, ids=range(len(SHARED_VALUE_BOMBS)))
def test_shared_value_bombs_are_refused(payload):
    with pytest.raises(TemplateError) as e:
        ChatTemplate("evil", payload, time_limit=30.0).render(CONV)
    assert "\n" not in str(e.value)


# Each of these used to build its whole result (~100 MB) before the size check saw it.
AMPLIFIERS = [
    "{{ 'a'.ljust(10**8) }}",
    "{{ 'a'.encode().zfill(10**8) }}",
    "{{ (1).to_bytes(10**8, 'big') }}",
    "{{ ('a' * 10000).replace('a', 'b' * 10000) }}",
    "{{ ('a' * 10000) | replace('a', 'b' * 10000) }}",
    "{{ ('x\n' * 10000) | indent(9999) }}",
    "{{ ('{0}' * 100).format('x' * 1000000) }}",
    "{{ ('%(a)s' * 100) % {'a': 'x' * 1000000} }}",
    "{{ ('\t' * 100000).expandtabs(1000) }}",
    "{{ ('a' * 1000).translate({97: 'b' * 100000}) }}",
    "{{ ('a' * 100) | join('y' * 1000000) }}",
]


@pytest.mark.parametrize("payload", AMPLIFIERS)
def test_amplifiers_are_refused_before_allocating(payload):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match="output too large"):
            ChatTemplate("evil", payload, time_limit=30.0).render(CONV)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 30_000_000, peak


def test_time_limit_reaches_pure_python_filters():
    # striptags loops in Python; the deadline used to be checked only in template code,
    # so a render ending in one long filter call finished late instead of being stopped.
    src = "{{ x | striptags }}"
    with pytest.raises(TemplateError, match="took longer than 0.2 s"):
        ChatTemplate("slow", src, time_limit=0.2).render(CONV, x="<a>" * 300000)


def test_endless_loop_is_stopped_by_the_time_limit():
    src = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError, match="took longer than 0.3 s"):
        ChatTemplate("slow", src, time_limit=0.3).render(CONV)


def test_output_size_limit():
    src = "{% for i in range(100000) %}{{ messages | tojson }}{{ 'x' * 100 }}{% endfor %}"
    with pytest.raises(TemplateError, match="output too large"):  # whatever the machine's speed
        ChatTemplate("big", src, time_limit=600).render(CONV)


def test_bad_messages():
    with pytest.raises(TemplateError, match="message 0"):
        builtin("gemma", "", "").render([{"content": "no role"}])


def test_syntax_error_names_line():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        ChatTemplate("broken", "ok\n{% for %}")


@pytest.mark.slow
def test_default_model_gets_gemma_turns(llm):
    assert template_for(llm).name == "gemma (built-in)"
    ids = apply_chat(llm, "Hi there", system="Be brief.")
    pieces = [llm.tokenizer.token_text(i) for i in ids]
    assert pieces[:4] == ["<bos>", "<start_of_turn>", "user", "\n"]
    assert pieces.count("<bos>") == 1
    assert pieces[-5:] == ["<end_of_turn>", "\n", "<start_of_turn>", "model", "\n"]
    assert llm.tokenizer.encode("<end_of_turn>", add_bos=False, special=True)[0] in (
        llm.tokenizer.eog_ids)
