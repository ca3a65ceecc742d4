"""The parameters of the OpenAI-shaped API and of the server, validated by one schema.

:class:`CompletionParams` and :class:`ChatParams` (pydantic models) describe every field that
:meth:`LLM.create_completion` / :meth:`LLM.create_chat_completion` take as keywords and that
``POST /v1/completions`` / ``POST /v1/chat/completions`` take in their bodies: OpenAI's
names, llama-server's sampler names (``repeat_penalty``, ``typical_p``, ``mirostat_mode``,
``dry_multiplier`` ...) and :class:`~localllm.sampling.chain.SamplingParams`' own field names.
:func:`parse` checks the raw value first (:func:`check_json`: depth, size, cycles, finite
numbers, valid UTF-8) and then the model; whatever is wrong becomes one
:class:`InvalidRequest` naming the field (``messages[0].content[1].text: Input should be a
valid string``), which the server answers with a 400 and OpenAI's error object. Ranges of the
sampler parameters are checked by ``SamplingParams.validate`` (one place for the CLI, the
models.toml tables and this API); here they only get their types and the bounds that keep
them inside machine integers.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ..errors import ParameterError
from ..runtime.generate import DRAFT_MAX

MAX_JSON_DEPTH = 128  # nesting of any value in a request (the JSON-schema compiler's limit too)
MAX_JSON_NODES = 1 << 22  # values (containers and scalars) in one request, shared ones per use
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's limit

_INT32 = 2**31
_INT64 = 2**63
Int32 = Annotated[int, Field(ge=-_INT32, le=_INT32 - 1)]
Int64 = Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)]
Positive = Annotated[int, Field(ge=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
# llama.cpp's reasoning budget: -1 no limit, 0 no thinking, N tokens.
ReasoningBudget = Annotated[int, Field(ge=-1, le=_INT32 - 1)]
Name = Annotated[str, Field(min_length=1, max_length=256)]

M = TypeVar("M", bound=BaseModel)


def _one(n: int) -> int:
    if n != 1:
        raise PydanticCustomError("one_choice", "must be 1 (one sequence at a time)")
    return n


One = Annotated[int, AfterValidator(_one)]


class InvalidRequest(ParameterError):
    """A request parameter of the wrong type, out of range or unknown.

    Attributes:
        param: the field's path (``messages[0].content``), or None for the body as a whole;
            the server returns it as the error object's ``param``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- the raw value --------------------------------------------------------------------------
def _path(parts: tuple) -> str:
    if len(parts) > 8:  # a deep path: its start and its end say enough
        return _path(parts[:4]) + "..." + _path(parts[-2:]).lstrip(".")
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_json(value: Any, where: tuple = ()) -> None:
    """Check that ``value`` is plain JSON data of bounded size, without recursion.

    Accepted: None, bool, int, float (finite), str (valid UTF-8: no lone surrogates), list or
    tuple, dict with str (or int) keys. The walk is iterative, so a value nested deeper than
    Python's recursion limit is refused here rather than crashing a recursive consumer
    (templates, ``strict_schema``, ``json.dumps``) later.

    Raises:
        InvalidRequest: nesting deeper than :data:`MAX_JSON_DEPTH`, more than
            :data:`MAX_JSON_NODES` values, a container that contains itself, NaN or infinity,
            a lone surrogate, or a value of another type; the message names its path.
    """
    nodes = 0
    on_path: set[int] = set()
    stack: list[tuple[Any, tuple, bool]] = [(value, where, False)]
    while stack:
        item, path, leaving = stack.pop()
        if leaving:
            on_path.discard(id(item))
            continue
        nodes += 1
        if nodes > MAX_JSON_NODES:
            raise InvalidRequest(f"the request holds more than {MAX_JSON_NODES} values")
        if item is None or isinstance(item, (bool, int)):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidRequest(f"{_path(path) or 'value'}: must be a finite number, "
                                     f"got {item!r}", _path(path) or None)
            continue
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if not isinstance(item, (list, tuple, dict)):
            raise InvalidRequest(f"{_path(path) or 'value'}: {type(item).__name__} is not a "
                                 "JSON value", _path(path) or None)
        if len(path) - len(where) >= MAX_JSON_DEPTH:
            raise InvalidRequest(f"{_path(path) or 'value'}: nested more than "
                                 f"{MAX_JSON_DEPTH} levels deep", _path(path) or None)
        if id(item) in on_path:
            raise InvalidRequest(f"{_path(path) or 'value'}: contains itself",
                                 _path(path) or None)
        on_path.add(id(item))
        stack.append((item, path, True))
        if isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str):
                    _check_text(key, path)
                elif isinstance(key, bool) or not isinstance(key, int):
                    raise InvalidRequest(f"{_path(path) or 'value'}: keys must be strings, got "
                                         f"{type(key).__name__}", _path(path) or None)
                stack.append((sub, (*path, key), False))
        else:
            stack.extend((sub, (*path, i), False) for i, sub in enumerate(item))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # "\ud800" in JSON decodes to a lone surrogate
        where = _path(path) or "value"
        raise InvalidRequest(f"{where}: text is not valid Unicode (lone surrogate at "
                             f"character {e.start})", _path(path) or None) from None


# ---- validation -------------------------------------------------------------------------------
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple"}


def _field_path(loc: tuple) -> str:
    """The user's path of a pydantic error location, without union tags (``#list``,
    ``list[str]``, model names)."""
    parts = [p for p in loc if isinstance(p, int) or not (
        p.startswith("#") or any(c in p for c in "[]'(") or p in _TYPE_TAGS
        or p in _MODEL_NAMES)]
    return _path(tuple(parts))


def _message(error: ValidationError) -> InvalidRequest:
    """One line for a pydantic error: the most specific one, alternatives of a union joined."""
    errors = error.errors(include_url=False)
    located = [(_field_path(e["loc"]), e) for e in errors]
    deepest = max(located, key=lambda x: x[0].count(".") + x[0].count("["))[0]
    mine = [e for path, e in located if path == deepest]
    first = mine[0]
    if first["type"] == "extra_forbidden":
        return InvalidRequest(f"unknown parameter '{deepest}'", deepest)
    if first["type"] == "missing":
        return InvalidRequest(f"{deepest}: required", deepest)
    text = first["msg"]
    for other in mine[1:]:
        more = other["msg"].removeprefix("Input should be ")
        if more != other["msg"] and more not in text:
            text += f" or {more}"
    return InvalidRequest(f"{deepest}: {text}" if deepest else text, deepest or None)


def parse(model: type[M], data: Any) -> M:
    """``data`` (a JSON object, or keyword arguments) as ``model``.

    Raises:
        InvalidRequest: see :func:`check_json`; a missing, unknown or ill-typed field (named).
    """
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _message(e) from None


def _kind(value: Any) -> str | None:
    if value is None:
        return "#null"
    if isinstance(value, bool):
        return "#bool"
    if isinstance(value, str):
        return "#str"
    if isinstance(value, (int, float)):
        return "#num"
    if isinstance(value, (list, tuple)):
        return "#list"
    if isinstance(value, dict):
        return "#dict"
    return None


def either(what: str, **members: Any) -> Any:
    """A union picked by the value's JSON type (``str=``, ``list=``, ``dict=``, ``num=``,
    ``bool=``, ``null=``), so that an error names the field, not a union member, and a value
    of no member's type gets "must be ``what``"."""
    tags = {f"#{k}" for k in members}

    def pick(value: Any) -> str | None:
        kind = _kind(value)
        return kind if kind in tags else None

    choices = tuple(Annotated[t, Tag(f"#{k}")] for k, t in members.items())
    return Annotated[Union[choices], Discriminator(  # noqa: UP007 - built from a tuple
        pick, custom_error_type="invalid_type", custom_error_message=f"must be {what}")]


def by_type_field(what: str, **members: Any) -> Any:
    """A union of models picked by their ``type`` field."""
    def pick(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return f"#{kind}" if isinstance(kind, str) and kind in members else None

    choices = tuple(Annotated[t, Tag(f"#{k}")] for k, t in members.items())
    return Annotated[Union[choices], Discriminator(  # noqa: UP007 - built from a tuple
        pick, custom_error_type="invalid_type", custom_error_message=f"must be {what}")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class _Open(BaseModel):
    """Objects that may carry more fields than we read (they reach the chat template)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


# ---- messages and tools -------------------------------------------------------------------------
class TextPart(_Open):
    type: Literal["text"]
    text: str


class FunctionCall(_Open):
    name: Name
    arguments: either("a JSON text or an object", str=str, dict=dict[str, Any]) = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    """One chat message (OpenAI's shape); extra fields go to the chat template as they are."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function", "ipython"]
    content: either("a string, a list of text parts or null", str=str,
                    list=list[TextPart], null=None) = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning (templates read it)


class FunctionDef(_Open):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _compiles(cls, value: dict | None) -> dict | None:
        # Checked on arrival: a malformed schema is an error naming the tool even where
        # the call grammar is lazy and would compile it only if the model opened a call.
        if value is not None:
            from ..errors import GrammarError
            from ..grammar.constraint import validate_json_schema

            try:
                validate_json_schema(value, "parameters")
            except GrammarError as e:
                raise PydanticCustomError("json_schema", "not a usable JSON schema ({reason})",
                                          {"reason": str(e).removeprefix("parameters: ")}
                                          ) from None
        return value


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class _FunctionName(_Model):
    name: Name


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: _FunctionName


class TextFormat(_Model):
    type: Literal["text"]


class JsonObjectFormat(_Model):
    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class JsonSchemaSpec(_Open):
    name: str | None = None
    description: str | None = None
    schema_: either("a JSON schema (an object or a boolean)", dict=dict[str, Any], bool=bool,
                    null=None) = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = by_type_field(
    "an object with type 'text', 'json_object' or 'json_schema'", text=TextFormat,
    json_object=JsonObjectFormat, json_schema=JsonSchemaFormat)


class StreamOptions(_Model):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# ---- sampling -----------------------------------------------------------------------------------
def _alias(*names: str) -> Any:
    return Field(None, validation_alias=AliasChoices(*names))


class SamplerFields(_Model):
    """llama.cpp's sampler parameters, by their llama-server / OpenAI names or by their
    :class:`~localllm.sampling.chain.SamplingParams` field names (the attribute names here).
    None: the model's default (models.toml), else llama.cpp's."""

    temp: float | None = _alias("temperature", "temp")
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    typ_p: float | None = _alias("typical_p", "typ_p")
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    penalty_last_n: Int32 | None = _alias("repeat_last_n", "penalty_last_n")
    penalty_repeat: float | None = _alias("repeat_penalty", "penalty_repeat")
    penalty_freq: float | None = _alias("frequency_penalty", "penalty_freq")
    penalty_present: float | None = _alias("presence_penalty", "penalty_present")
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: Int32 | None = None
    dry_penalty_last_n: Int32 | None = None
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    top_n_sigma: float | None = None
    mirostat: Int32 | None = _alias("mirostat_mode", "mirostat")
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    ignore_eos: bool | None = None
    # OpenAI's token id (as text) -> bias; llama-server's `false` bans the token.
    logit_bias: dict[Int32, either("a number, or false to ban the token", num=float,
                                   bool=Literal[False])] | None = None
    samplers: either("a list of sampler names or a ';'-separated string", str=str,
                     list=list[str], null=None) = None
    n_probs: TopLogprobs | None = None
    min_keep: Int32 | None = None
    seed: Int64 | None = None

    def sampling_overrides(self) -> dict[str, Any]:
        """The fields given, as SamplingParams keywords (``logit_bias`` False -> -inf,
        ``samplers`` text split, a seed of -1 -> None: a random seed, as llama.cpp)."""
        out = {name: getattr(self, name) for name in SamplerFields.model_fields
               if getattr(self, name) is not None}
        if "logit_bias" in out:
            out["logit_bias"] = {k: -math.inf if v is False else float(v)
                                 for k, v in out["logit_bias"].items()}
        if isinstance(out.get("samplers"), str):
            from ..sampling.chain import parse_samplers

            out["samplers"] = parse_samplers(out["samplers"])
        if out.get("seed") == -1:
            del out["seed"]
        return out


Stop = either(f"a string or a list of at most {MAX_STOP_STRINGS} strings",
              str=Annotated[str, Field(max_length=MAX_STOP_CHARS)],
              list=Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                             Field(max_length=MAX_STOP_STRINGS)],
              null=None)


class _Request(SamplerFields):
    """Fields common to both endpoints."""

    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    cache_prompt: bool = True
    n: One = 1
    # OpenAI fields that change nothing here (accepted so that clients need no change).
    model: str | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [s for s in stops if s]


class CompletionParams(_Request):
    """``create_completion`` / ``POST /v1/completions``."""

    prompt: either("text or a list of token ids", str=str, list=list[Int32])
    max_tokens: Positive | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False


class ChatParams(_Request):
    """``create_chat_completion`` / ``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: either("'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", str=Literal["none", "auto", "required"],
                        dict=NamedToolChoice, null=None) = None
    parallel_tool_calls: bool | None = None
    # A built-in template's name, a tokenizer.chat_template.NAME variant, or Jinja text;
    # never a file (see localllm.chat.template.select_template).
    chat_template: str | None = None
    # Template variables (llama-server's name): enable_thinking, reasoning_effort ...
    chat_template_kwargs: dict[str, Any] | None = None
    # Reasoning, as llama-server takes it: where it goes, how many tokens it may use.
    reasoning_format: Literal["none", "deepseek", "auto"] | None = None
    reasoning_budget_tokens: ReasoningBudget | None = Field(
        None, validation_alias=AliasChoices("reasoning_budget_tokens", "thinking_budget_tokens",
                                            "reasoning_budget"))
    # OpenAI's: passed to the template (gpt-oss's harmony reads it); "none": no thinking.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_messages(self) -> list[dict]:
        """The messages as dicts for the chat template (extra fields kept, None dropped)."""
        return [m.model_dump(exclude_none=True, by_alias=True) for m in self.messages]

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools or ()]


_MODEL_NAMES = {cls.__name__ for cls in (
    TextPart, FunctionCall, ToolCall, Message, FunctionDef, Tool, _FunctionName,
    NamedToolChoice, TextFormat, JsonObjectFormat, JsonSchemaSpec, JsonSchemaFormat,
    StreamOptions)}

# ---- LLM(...) ---------------------------------------------------------------------------------
_OPTION_FLAGS = {"ctx_size": "--ctx-size", "batch_size": "--batch-size", "device": "--device",
                 "draft_model": "--model-draft", "spec_ngram": "--spec-ngram",
                 "draft_max": "--draft-max", "draft_min": "--draft-min",
                 "draft_p_min": "--draft-p-min", "type_k": "--cache-type-k",
                 "type_v": "--cache-type-v", "ctx_checkpoints": "--ctx-checkpoints"}


class LLMOptions(_Model):
    """The keyword arguments of ``LLM(...)``."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ctx_size: Annotated[int, Field(ge=0, le=_INT32 - 1)] = 4096
    batch_size: Annotated[int, Field(ge=1, le=_INT32 - 1)] = 512
    verbose: bool = False
    progress: bool | None = None
    # speculative decoding (localllm.runtime.speculative; llama.cpp's flag names)
    draft_model: str | None = None
    spec_ngram: Annotated[int, Field(ge=0, le=64)] = 0
    draft_max: Annotated[int, Field(ge=1, le=64)] = DRAFT_MAX
    draft_min: Annotated[int, Field(ge=0, le=64)] = 0
    draft_p_min: Annotated[float, Field(ge=0.0, le=1.0)] = 0.8
    # KV cache element types (llama-cpp-python's names; a ggml type id or llama.cpp's -ctk
    # name, checked by localllm.memory.cache_type)
    type_k: int | str | None = None
    type_v: int | str | None = None
    # context checkpoints of a recurrent state kept per sequence (llama.cpp's
    # --ctx-checkpoints, default 8: localllm.memory.DEFAULT_CHECKPOINTS)
    ctx_checkpoints: Annotated[int, Field(ge=0, le=1024)] = 8


def parse_options(options: dict[str, Any]) -> LLMOptions:
    """``LLM(...)``'s keywords, validated; errors name the keyword (and its CLI flag).

    Raises:
        ParameterError: an unknown keyword, a wrong type or a value out of range.
    """
    try:
        return LLMOptions.model_validate(options)
    except ValidationError as e:
        err = _message(e)
        if str(err).startswith("unknown parameter"):
            name = err.param
            known = ", ".join(["model", *LLMOptions.model_fields, "dtype"])
            raise ParameterError(f"LLM() got an unknown keyword argument '{name}' "
                                 f"(known: {known})") from None
        flag = _OPTION_FLAGS.get(err.param or "")
        raise ParameterError(f"{err} ({flag})" if flag else str(err)) from None


# ---- embeddings and tokens (the server's /v1/embeddings, /tokenize, /detokenize) ---------------
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingParams(_Model):
    """``POST /v1/embeddings`` (OpenAI's fields)."""

    input: either("a string, a list of strings, token ids or a list of token-id lists",
                  str=str, list=Annotated[list[either(
                      "a string, a token id or a list of token ids", str=str, num=Int32,
                      list=list[Int32])], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a text or token ids (a flat list of ids is one input).

        Raises:
            InvalidRequest: texts and ids mixed in one list.
        """
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(x, int) for x in self.input):
            return [list(self.input)]
        if any(isinstance(x, int) for x in self.input):
            raise InvalidRequest("input: a list mixes token ids with other inputs", "input")
        return list(self.input)


class TokenizeParams(_Model):
    """llama-server's ``POST /tokenize``."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None


class DetokenizeParams(_Model):
    """llama-server's ``POST /detokenize``."""

    tokens: list[Int32]
    model: str | None = None
