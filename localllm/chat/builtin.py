"""Built-in chat templates (our own Jinja), used when a model's metadata carries none.

Each reproduces the turn format of a model family as documented by its authors; the
wording of tool instructions is ours. They share the ``text`` macro, which accepts a
message ``content`` given as a string, as OpenAI-style parts (``[{"type": "text",
"text": ...}]``) or as None.
"""

from __future__ import annotations

_PRELUDE = """\
{%- macro text(c) -%}
  {%- if c is string -%}{{ c }}
  {%- elif c is mapping -%}{{ c.get('text', '') }}
  {%- elif c is iterable -%}
    {%- for p in c -%}
      {%- if p is string -%}{{ p }}{%- elif p.type == 'text' -%}{{ p.text }}{%- endif -%}
    {%- endfor -%}
  {%- elif c is defined and c is not none -%}{{ c }}
  {%- endif -%}
{%- endmacro -%}
{%- macro call_json(call) -%}
  {%- set f = call.function if call.function is defined else call -%}
  {{- {'name': f.name, 'arguments': f.arguments} | tojson -}}
{%- endmacro -%}
"""

# Gemma: "model" is the assistant role; there is no system role, so the system text is
# folded into the first user turn, as Google's template does.
_GEMMA = """\
{{- bos_token -}}
{%- set ns = namespace(prefix='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.prefix = text(messages[0]['content']) | trim ~ '\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
  {%- set ns.prefix = ns.prefix ~ 'Tools you can call (JSON schemas):\\n' ~ (tools | tojson(indent=2))
      ~ '\\nTo call one, reply with only ```tool_call\\n{"name": ..., "arguments": {...}}\\n```\\n\\n' -%}
{%- endif -%}
{%- for m in loop_messages -%}
  {{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\\n' -}}
  {%- if loop.first -%}{{ ns.prefix }}{%- endif -%}
  {%- if m['role'] == 'tool' -%}
    {{- '```tool_response\\n' ~ text(m['content']) | trim ~ '\\n```' -}}
  {%- else -%}
    {{- text(m['content']) | trim -}}
  {%- endif -%}
  {%- for call in m.tool_calls or [] -%}
    {{- '```tool_call\\n' ~ call_json(call) ~ '\\n```' -}}
  {%- endfor -%}
  {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

# Llama 3: header-delimited turns; tool results use the "ipython" role.
_LLAMA3 = """\
{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = text(messages[0]['content']) | trim -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
  {%- set ns.system = (ns.system ~ '\\n\\n' if ns.system else '')
      ~ 'You can call these functions. To call one, reply with only a JSON object '
      ~ '{"name": function name, "parameters": {argument: value}}.\\n' -%}
  {%- for t in tools -%}{%- set ns.system = ns.system ~ '\\n' ~ (t | tojson(indent=4)) -%}{%- endfor -%}
{%- endif -%}
{%- if ns.system -%}
  {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' ~ ns.system ~ '<|eot_id|>' -}}
{%- endif -%}
{%- for m in loop_messages -%}
  {{- '<|start_header_id|>' ~ ('ipython' if m['role'] == 'tool' else m['role'])
      ~ '<|end_header_id|>\\n\\n' -}}
  {{- text(m['content']) | trim -}}
  {%- for call in m.tool_calls or [] -%}{{ call_json(call) }}{%- endfor -%}
  {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}
"""

# ChatML (Qwen, many fine-tunes); tools in the Qwen 2.5 style: <tools> in the system turn,
# <tool_call> in assistant turns, <tool_response> in a user turn.
_CHATML = """\
{%- set has_system = messages and messages[0]['role'] == 'system' -%}
{%- set loop_messages = messages[1:] if has_system else messages -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if has_system -%}{{ text(messages[0]['content']) ~ '\\n\\n' }}{%- endif -%}
  {{- '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' -}}
  {%- for t in tools -%}{{ '\\n' ~ (t | tojson) }}{%- endfor -%}
  {{- '\\n</tools>\\n\\nFor each call, reply with a JSON object inside <tool_call></tool_call>:\\n'
      ~ '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
      ~ '<|im_end|>\\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\\n' ~ text(messages[0]['content']) ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in loop_messages -%}
  {%- if m['role'] == 'tool' -%}
    {{- '<|im_start|>user\\n<tool_response>\\n' ~ text(m['content'])
        ~ '\\n</tool_response><|im_end|>\\n' -}}
  {%- else -%}
    {{- '<|im_start|>' ~ m['role'] -}}
    {%- set body = text(m['content']) -%}
    {%- if body or not m.tool_calls -%}{{ '\\n' ~ body }}{%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {{- '\\n<tool_call>\\n' ~ call_json(call) ~ '\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""

# Mistral (v1 instruct): the system text is prepended to the first user message.
_MISTRAL = """\
{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = text(messages[0]['content']) ~ '\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
  {{- '[AVAILABLE_TOOLS] ' ~ (tools | tojson) ~ '[/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{%- for m in loop_messages -%}
  {%- if m['role'] == 'user' -%}
    {{- '[INST] ' ~ (ns.system if loop.first else '') ~ text(m['content']) | trim ~ ' [/INST]' -}}
  {%- elif m['role'] == 'assistant' -%}
    {{- ' ' ~ text(m['content']) | trim -}}
    {%- for call in m.tool_calls or [] -%}{{ '[TOOL_CALLS] ' ~ call_json(call) }}{%- endfor -%}
    {{- eos_token -}}
  {%- elif m['role'] == 'tool' -%}
    {{- '[TOOL_RESULTS] ' ~ text(m['content']) ~ '[/TOOL_RESULTS]' -}}
  {%- else -%}
    {{- raise_exception('mistral template: unsupported role ' ~ m['role']) -}}
  {%- endif -%}
{%- endfor -%}
"""

# Llama 2 chat: <<SYS>> block inside the first [INST].
_LLAMA2 = """\
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = '<<SYS>>\\n' ~ text(messages[0]['content']) | trim ~ '\\n<</SYS>>\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for m in loop_messages -%}
  {%- if m['role'] == 'assistant' -%}
    {{- ' ' ~ text(m['content']) | trim ~ ' ' ~ eos_token -}}
  {%- else -%}
    {{- bos_token ~ '[INST] ' ~ (ns.system if loop.first else '') ~ text(m['content']) | trim
        ~ ' [/INST]' -}}
  {%- endif -%}
{%- endfor -%}
"""

# Phi-3: <|role|> markers, <|end|> after each turn.
_PHI3 = """\
{%- for m in messages -%}
  {{- '<|' ~ ('user' if m['role'] == 'tool' else m['role']) ~ '|>\\n' ~ text(m['content']) -}}
  {%- for call in m.tool_calls or [] -%}{{ call_json(call) }}{%- endfor -%}
  {{- '<|end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}
"""

# gpt-oss's harmony format (OpenAI's harmony documentation; the official template is
# models/templates/openai-gpt-oss-120b.jinja in llama.cpp): a system message with the
# reasoning effort, a developer message with the instructions and the tools (written by
# localllm.chat.harmony_tools, the global `harmony_functions`), then user, assistant (final
# channel; analysis only for tool calls no later answer follows) and tool messages.
# Differences from the official template, on purpose (tests/test_harmony_render.py):
# each tool call is its own `<|start|>assistant<|channel|>commentary to=functions.NAME
# <|constrain|>json<|message|>ARGS<|call|>` (as the model writes it; the official template
# puts `to=` in the header, drops `<|constrain|>` and writes only the first call); a tool
# result is written as the tool returned it (the official template JSON-quotes it) under
# the name of the call its tool_call_id names; reasoning_effort minimal/xhigh are low/high,
# enable_thinking=false is low, another value is an error; the leading system and developer
# messages are the instructions together, and a later one is a developer message in its
# place (the official template takes the first and drops the others); an unknown role is
# an error (the official template drops it).
_HARMONY = """\
{%- if reasoning_effort is defined and reasoning_effort is not none -%}
  {%- set effort = reasoning_effort | string | lower -%}
{%- elif enable_thinking is defined and enable_thinking is false -%}
  {%- set effort = 'low' -%}
{%- else -%}
  {%- set effort = 'medium' -%}
{%- endif -%}
{%- set effort = {'minimal': 'low', 'xhigh': 'high'}.get(effort, effort) -%}
{%- if effort not in ('low', 'medium', 'high') -%}
  {{- raise_exception('reasoning_effort must be low, medium or high, not ' ~ effort) -}}
{%- endif -%}
{{- '<|start|>system<|message|>'
    ~ (model_identity if model_identity is defined
       else 'You are ChatGPT, a large language model trained by OpenAI.')
    ~ '\\nKnowledge cutoff: 2024-06\\nCurrent date: ' ~ strftime_now('%Y-%m-%d')
    ~ '\\n\\nReasoning: ' ~ effort ~ '\\n\\n# Valid channels: analysis, commentary, final. '
    ~ 'Channel must be included for every message.' -}}
{%- if tools -%}
  {{- "\\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- set ns = namespace(lead=0, instructions=[], names=[], ids=[], results=0, final=false) -%}
{%- for m in messages -%}
  {%- if ns.lead == loop.index0 and m['role'] in ('system', 'developer') -%}
    {%- set ns.lead = loop.index -%}
    {%- set ns.instructions = ns.instructions + [text(m['content'])] -%}
  {%- endif -%}
{%- endfor -%}
{%- set instructions = ns.instructions | select | join('\n\n') -%}
{%- set loop_messages = messages[ns.lead:] -%}
{%- if instructions or tools -%}
  {{- '<|start|>developer<|message|>' -}}
  {%- if instructions -%}{{- '# Instructions\\n\\n' ~ instructions ~ '\\n\\n' -}}{%- endif -%}
  {%- if tools -%}{{- '# Tools\\n\\n' ~ harmony_functions() -}}{%- endif -%}
  {{- '<|end|>' -}}
{%- endif -%}
{%- for m in loop_messages -%}
  {%- set role = m['role'] -%}
  {%- set at = loop.index0 + messages | length - loop_messages | length -%}
  {%- if role == 'assistant' -%}
    {%- set body = text(m['content']) -%}
    {%- set thinking = text(m['thinking']) if m['thinking'] is defined else '' -%}
    {%- for marker in ('<|channel|>analysis<|message|>', '<|channel|>final<|message|>') -%}
      {%- if marker in body or marker in thinking -%}
        {{- raise_exception('message ' ~ at ~ ': an assistant message holds harmony channel '
            ~ 'markers; give the analysis text as reasoning_content, the final as content') -}}
      {%- endif -%}
    {%- endfor -%}
    {%- if m.tool_calls -%}
      {%- set ns.final = false -%}
      {%- for later in loop_messages[loop.index:] -%}
        {%- if later['role'] == 'assistant' and not later.tool_calls -%}
          {%- set ns.final = true -%}
        {%- endif -%}
      {%- endfor -%}
      {%- if body and thinking -%}
        {{- raise_exception('message ' ~ at ~ ': an assistant message with tool '
            ~ 'calls has both content and reasoning; harmony has one analysis message') -}}
      {%- elif (body or thinking) and not ns.final -%}
        {{- '<|start|>assistant<|channel|>analysis<|message|>' ~ (body or thinking)
            ~ '<|end|>' -}}
      {%- endif -%}
      {%- set ns.names = [] -%}
      {%- set ns.ids = [] -%}
      {%- set ns.results = 0 -%}
      {%- for call in m.tool_calls -%}
        {%- set f = call.function if call.function is defined else call -%}
        {%- if f.name is not string or not f.name -%}
          {{- raise_exception('message ' ~ at ~ ': a tool call without a name') -}}
        {%- endif -%}
        {{- '<|start|>assistant<|channel|>commentary to=functions.' ~ f.name
            ~ ' <|constrain|>' ~ (f.content_type if f.content_type is defined else 'json')
            ~ '<|message|>' ~ (f.arguments if f.arguments is string else
                               (f.arguments if f.arguments is defined else {}) | tojson)
            ~ '<|call|>' -}}
        {%- set ns.names = ns.names + [f.name] -%}
        {%- set ns.ids = ns.ids + [call.id if call.id is defined else none] -%}
      {%- endfor -%}
    {%- elif loop.last and not add_generation_prompt -%}
      {%- if m['thinking'] is defined -%}
        {{- '<|start|>assistant<|channel|>analysis<|message|>' ~ thinking ~ '<|end|>' -}}
      {%- endif -%}
      {{- '<|start|>assistant<|channel|>final<|message|>' ~ body ~ '<|return|>' -}}
    {%- else -%}
      {{- '<|start|>assistant<|channel|>final<|message|>' ~ body ~ '<|end|>' -}}
      {%- set ns.names = [] -%}
    {%- endif -%}
  {%- elif role == 'tool' -%}
    {%- if not ns.names -%}
      {{- raise_exception('message ' ~ at ~ ': a tool result with no assistant tool '
          ~ 'call before it') -}}
    {%- endif -%}
    {%- if m.tool_call_id is defined and m.tool_call_id in ns.ids -%}
      {%- set name = ns.names[ns.ids.index(m.tool_call_id)] -%}
    {%- else -%}
      {%- set name = ns.names[[ns.results, ns.names | length - 1] | min] -%}
    {%- endif -%}
    {%- set ns.results = ns.results + 1 -%}
    {{- '<|start|>functions.' ~ name ~ ' to=assistant<|channel|>commentary<|message|>'
        ~ text(m['content']) ~ '<|end|>' -}}
  {%- elif role == 'user' -%}
    {{- '<|start|>user<|message|>' ~ text(m['content']) ~ '<|end|>' -}}
  {%- elif role in ('system', 'developer') -%}
    {{- '<|start|>developer<|message|>' ~ text(m['content']) ~ '<|end|>' -}}
  {%- else -%}
    {{- raise_exception('message ' ~ at ~ ': harmony has no ' ~ role ~ ' role') -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {
    name: _PRELUDE + body
    for name, body in {
        "gemma": _GEMMA,
        "llama3": _LLAMA3,
        "chatml": _CHATML,
        "mistral": _MISTRAL,
        "llama2": _LLAMA2,
        "phi3": _PHI3,
        "harmony": _HARMONY,
    }.items()
}

# Vocabulary marker -> template: a token only that family's vocabulary has.
_VOCAB_MARKERS = (
    ("<|channel|>", "harmony"),
    ("<start_of_turn>", "gemma"),
    ("<|start_header_id|>", "llama3"),
    ("<|im_start|>", "chatml"),
    ("<|assistant|>", "phi3"),
    ("[INST]", "mistral"),
)
_ARCH_DEFAULTS = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "qwen2": "chatml", "qwen3": "chatml", "qwen2moe": "chatml", "qwen3moe": "chatml",
    "phi3": "phi3", "mistral": "mistral", "mistral3": "mistral", "gpt-oss": "harmony",
}


def guess_builtin(metadata: dict) -> str:
    """Name of the built-in template for a model without one in its metadata.

    Decided by a turn-marker token of the vocabulary, then the architecture
    (``general.architecture``); a llama SentencePiece vocabulary gets llama2, any other
    model ChatML.
    """
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    vocab = set(tokens) if len(tokens) < 2_000_000 else set()
    for marker, name in _VOCAB_MARKERS:
        if marker in vocab:
            return name
    arch = str(metadata.get("general.architecture", ""))
    if arch in _ARCH_DEFAULTS:
        return _ARCH_DEFAULTS[arch]
    if arch == "llama":
        return "llama2" if metadata.get("tokenizer.ggml.model") == "llama" else "llama3"
    return "chatml"
