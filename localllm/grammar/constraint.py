"""Grammar-constrained decoding: GBNF grammars and JSON schemas, enforced with llguidance.

A :class:`GrammarConstraint` plugs into the sampler chain (``build_sampler(...,
constraint=...)``): :meth:`~GrammarConstraint.apply` sets the logits of every token the
grammar forbids to -inf, :meth:`~GrammarConstraint.accept` advances the matcher. The token
masks come from llguidance (Moskal et al., https://github.com/guidance-ai/llguidance), an
Earley parser over a lazily built lexer DFA that walks the vocabulary trie; llama.cpp uses
the same library with ``-DLLAMA_LLGUIDANCE=ON``. GBNF is parsed and checked by our own
:mod:`localllm.grammar.gbnf` first, so that errors carry ``file:line:col``.
"""

from __future__ import annotations

import json
import math
import re
import weakref
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch

from ..data import GRAMMARS_DIR  # the ready grammars (package data)
from ..errors import GrammarError, LocalLLMError, ParameterError
from ..tokenizer import USER_DEFINED
from .gbnf import gbnf_to_lark
from .schema import check_sizes

# Resource limits handed to llguidance (its defaults, made explicit, a little tighter on
# grammar size): compile time and memory stay bounded whatever grammar a user passes.
_LIMITS = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,  # ~20 ms of regex analysis at compile time
    "step_lexer_fuel": 200_000,  # ~15 ms of lexer work per token, worst case
    "step_max_items": 50_000,
    "max_lexer_states": 100_000,  # ~100-200 MB
    "max_grammar_size": 200_000,
}

# JSON output on one line with fixed separators: the value pipes straight into `jq`, and a
# small model cannot wander off into runs of whitespace.
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,  # unsupported keywords are errors, not silently ignored
}

# Bounds on a JSON schema, checked before llguidance sees it. llguidance compiles schemas
# recursively in native code: a chain of 3,000 `$ref`s overflowed its stack (SIGSEGV), and
# Python's own json module raises RecursionError near 1,000 levels of nesting.
MAX_SCHEMA_DEPTH = 128  # nesting, counting each followed `$ref` as one more level
MAX_SCHEMA_NODES = 100_000  # objects, arrays and scalars in the schema
MAX_SCHEMA_CHARS = 4_000_000  # characters of all keys and strings together
MAX_SCHEMA_INT = 2**64  # integer literals beyond +-2^64 (llguidance reads i64/u64/f64)

_TOKENIZER_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**_LIMITS, verbose_errors=False)


def _first_line(message: str) -> str:
    """llguidance's (possibly multi-line) message as one line."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    text = text or "unknown error"
    return text if len(text) <= 300 else text[:297] + "..."


def _key_path(schema: Any, key: str, path: str = "") -> str | None:
    """JSON pointer of the first object in ``schema`` that has ``key`` (for error messages)."""
    if isinstance(schema, dict):
        if key in schema:
            return path or "/"
        items = schema.items()
    elif isinstance(schema, list):
        items = enumerate(schema)
    else:
        return None
    for k, v in items:
        found = _key_path(v, key, f"{path}/{k}")
        if found:
            return found
    return None


def _resolve_pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` ("#", "#/$defs/a", with ~0 ~1 escapes) names, or None."""
    if not ref.startswith("#"):
        return None
    from urllib.parse import unquote

    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def validate_json_schema(schema: Any, source: str = "<json-schema>") -> None:
    """Check that ``schema`` compiles (bounded, as :func:`check_schema`, then by llguidance
    itself, with no tokenizer): a request's tool schemas are checked when it arrives, so
    that a malformed one is an error naming the tool, whatever ``tool_choice`` says.

    Raises:
        GrammarError: ``source: message``.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"{source}: a JSON schema must be an object, not "
                           f"{type(schema).__name__}")
    check_schema(schema, source)
    check_sizes(schema, source)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RecursionError) as e:
        error = str(e)
    if error:
        raise GrammarError(f"{source}: {_first_line(error)}")


def check_schema(schema: Any, source: str = "<json-schema>") -> None:
    """Reject a schema too large or too deep to compile safely, before llguidance sees it.

    Iterative, in time linear in the schema's size: counts nodes (:data:`MAX_SCHEMA_NODES`)
    and characters (:data:`MAX_SCHEMA_CHARS`), rejects integers beyond ±2^64, non-finite
    numbers and values that are not JSON, and bounds the nesting depth with each local
    ``$ref`` followed (:data:`MAX_SCHEMA_DEPTH`; a reference back into its own chain, a
    recursive schema, adds nothing).

    Raises:
        GrammarError: ``source: message`` naming the limit.
    """
    nodes = chars = 0
    depth: dict[int, int] = {}  # id(container) -> its depth, once done
    on_stack: set[int] = set()

    def children(node: Any) -> list[Any]:
        nonlocal nodes, chars
        kids = list(node.values()) if isinstance(node, dict) else list(node)
        nodes += len(kids)
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, str):
                    raise GrammarError(f"{source}: a schema key is not a string: {key!r}")
                chars += len(key)
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = _resolve_pointer(schema, ref)
                if isinstance(target, (dict, list)):
                    kids.append(target)
        for kid in kids:
            if isinstance(kid, str):
                chars += len(kid)
            elif isinstance(kid, bool) or kid is None:
                pass
            elif isinstance(kid, int):
                if not -MAX_SCHEMA_INT <= kid <= MAX_SCHEMA_INT:
                    raise GrammarError(f"{source}: an integer in the schema is beyond ±2^64")
            elif isinstance(kid, float):
                if not math.isfinite(kid):
                    raise GrammarError(f"{source}: a number in the schema is not finite")
            elif not isinstance(kid, (dict, list)):
                raise GrammarError(
                    f"{source}: a schema value is not JSON ({type(kid).__name__})")
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"{source}: the schema has more than {MAX_SCHEMA_NODES} values")
        if chars > MAX_SCHEMA_CHARS:
            raise GrammarError(
                f"{source}: the schema has more than {MAX_SCHEMA_CHARS} characters of text")
        return [k for k in kids if isinstance(k, (dict, list))]

    if not isinstance(schema, (dict, list)):
        return
    stack = [(schema, iter(children(schema)))]
    on_stack.add(id(schema))
    best = {id(schema): 1}
    while stack:
        node, it = stack[-1]
        kid = next(it, None)
        if kid is None:
            stack.pop()
            on_stack.discard(id(node))
            depth[id(node)] = best[id(node)]
            if stack:
                parent = id(stack[-1][0])
                best[parent] = max(best[parent], depth[id(node)] + 1)
            continue
        if id(kid) in on_stack:
            continue
        if id(kid) in depth:
            best[id(node)] = max(best[id(node)], depth[id(kid)] + 1)
            if best[id(node)] + len(stack) - 1 > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"{source}: the schema is nested deeper than "
                                   f"{MAX_SCHEMA_DEPTH} levels (counting $ref chains)")
            continue
        if len(stack) >= MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{source}: the schema is nested deeper than "
                               f"{MAX_SCHEMA_DEPTH} levels (counting $ref chains)")
        on_stack.add(id(kid))
        best[id(kid)] = 1
        stack.append((kid, iter(children(kid))))


class _VocabWrapper:
    """What ``llguidance.TokenizerWrapper`` reads: per-token bytes, EOS, and an encoder."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        n = tokenizer.n_vocab
        tokens: list[bytes] = []
        special: list[int] = []
        types = getattr(tokenizer, "types", None)

        def user_defined(i: int) -> bool:
            return types is not None and types[i] == USER_DEFINED

        for i in range(n):
            data = tokenizer.token_bytes(i)
            text = tokenizer.token_text(i)
            # Control tokens (and user-defined ones that look like control tokens, as
            # llama.cpp's llguidance glue does) never match grammar text; llguidance
            # recognises special tokens by a leading 0xFF byte, which UTF-8 never contains.
            if tokenizer.is_control(i) or not data or (
                user_defined(i) and len(text) > 2 and text[0] == "<" and text[-1] == ">"
            ):
                tokens.append(b"\xff" + text.encode("utf-8", errors="replace"))
                special.append(i)
            else:
                tokens.append(data)
        self.tokens = tokens
        self.special_token_ids = special
        eos = tokenizer.eos_id
        self.eos_token_id = eos if eos is not None else min(tokenizer.eog_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self._byte_tokens = {data[0]: i for i, data in enumerate(tokens) if len(data) == 1}

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance only uses this for its own tokenize_* helpers; the ids must decode to
        # exactly `text`, which an SPM encoder with a space prefix does not promise.
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tok.encode(data.decode("utf-8", errors="replace"), add_bos=False)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return [self._byte_tokens[b] for b in data if b in self._byte_tokens]


_TOKEN_INDEX_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_index(tokenizer: Any) -> dict[str, int | None]:
    """Token text -> id, for GBNF's ``<token-text>`` references (None: the text belongs to
    several tokens, so it names none). Built once per tokenizer: one pass over the
    vocabulary, instead of one per reference (2,000 references took 43 s)."""
    index = _TOKEN_INDEX_CACHE.get(tokenizer)
    if index is None:
        index = {}
        for i in range(tokenizer.n_vocab):
            text = tokenizer.token_text(i)
            index[text] = None if text in index else i
        _TOKEN_INDEX_CACHE[tokenizer] = index
    return index


def lltokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of our :class:`~localllm.tokenizer.Tokenizer`, cached.

    Building it walks the whole vocabulary (about 2 s for 262,144 tokens), so it is kept
    per tokenizer object. All end-of-generation ids count as EOS.
    """
    cached = _TOKENIZER_CACHE.get(tokenizer)
    if cached is None:
        eos = sorted(tokenizer.eog_ids) or (
            [tokenizer.eos_id] if tokenizer.eos_id is not None else None
        )
        cached = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_VocabWrapper(tokenizer)), eos_token=eos
        )
        _TOKENIZER_CACHE[tokenizer] = cached
    return cached


class GrammarConstraint:
    """A grammar the generated text must follow, as a token mask per step.

    Use :meth:`from_gbnf`, :meth:`from_json_schema` or :meth:`any_json`. The sampler chain
    calls :meth:`apply` on the logits before sampling (or, on llama.cpp's fast path,
    :meth:`is_allowed` on the sampled token first) and :meth:`accept` after.

    Raises:
        GrammarError: the grammar does not compile within the resource limits.
    """

    def __init__(self, grammar: str, tokenizer: Any, *, source: str = "<grammar>") -> None:
        self.source = source
        self.tokenizer = tokenizer
        self._lltok = lltokenizer(tokenizer)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._lltok, limits=_limits()
        )
        if is_error:
            raise GrammarError(f"{source}: {_first_line(messages[0])}")
        self._grammar = grammar
        self._matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0, limits=_limits())
        self._check()
        self.n_vocab = self._lltok.vocab_size
        self._bitmask = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._eog = frozenset(tokenizer.eog_ids)

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_gbnf(
        cls, text: str, tokenizer: Any, *, source: str = "<grammar>"
    ) -> GrammarConstraint:
        """Compile GBNF ``text`` (llama.cpp's grammar format).

        Raises:
            GrammarError: ``source:line:col: message`` (see :mod:`localllm.grammar.gbnf`).
        """

        lark = gbnf_to_lark(text, source, token_index(tokenizer).get)
        return cls(llguidance.LLMatcher.grammar_from_lark(lark), tokenizer, source=source)

    @classmethod
    def from_json_schema(
        cls, schema: dict | bool | str, tokenizer: Any, *, source: str = "<json-schema>"
    ) -> GrammarConstraint:
        """Compile a JSON schema (a dict, or its JSON text) to a constraint.

        Output is one line, with ``", "`` and ``": "`` as separators.

        Raises:
            GrammarError: the text is not JSON (``source:line:col``), the schema is not an
                object, it uses a keyword llguidance does not implement, or a size keyword
                or ``pattern`` count is above :data:`~localllm.grammar.schema.MAX_SCHEMA_SIZE`
                (:func:`~localllm.grammar.schema.check_sizes`).
        """
        if isinstance(schema, str):
            schema = _loads(schema, source)
        if not isinstance(schema, (dict, bool)):
            kind = type(schema).__name__
            raise GrammarError(f"{source}: a JSON schema must be an object, not {kind}")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        check_schema(schema, source)
        check_sizes(schema, source)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"{source}: {_first_line(str(e))}") from None
        try:
            constraint = cls(grammar, tokenizer, source=source)
            constraint.json_schema = schema  # lets generation steer to a complete value
            return constraint
        except GrammarError as e:
            # Name where an unsupported keyword sits: "Unimplemented keys: ["foo"]".
            m = re.search(r'Unimplemented keys: \["([^"]+)"', str(e))
            where = _key_path(schema, m.group(1)) if m else None
            if where is None:
                raise
            raise GrammarError(
                f"{source}: unsupported JSON-schema keyword '{m.group(1)}' at {where}"
            ) from None

    @classmethod
    def any_json(cls, tokenizer: Any) -> GrammarConstraint:
        """Any single JSON value (object, array, string, number, true, false, null)."""
        return cls.from_json_schema({}, tokenizer, source="--json")

    # ---- the sampler-chain protocol ---------------------------------------------------------
    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"{self.source}: {_first_line(self._matcher.get_error())}")

    def allowed_mask(self) -> torch.Tensor:
        """Allowed tokens now: bool tensor (n_vocab,) over the llguidance vocabulary."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        self._check()
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.n_vocab]
        return torch.from_numpy(bits.view(np.bool_))

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place.

        Args:
            logits: float tensor (n,), any device; entries beyond the vocabulary (a model
                whose output is padded) are forbidden, a shorter tensor is masked as far as
                it goes.
        Raises:
            GrammarError: the matcher hit a resource limit or an earlier token broke it.
        """
        allowed = self.allowed_mask()
        n = min(logits.shape[-1], self.n_vocab)
        if logits.device.type == "cpu" and logits.dim() == 1 and logits.is_contiguous():
            # numpy's single-threaded putmask: torch's masked_fill over 262k entries wakes
            # its thread pool, which costs milliseconds on a busy machine.
            view = logits.numpy()
            np.putmask(view[:n], ~allowed.numpy()[:n], -np.inf)
            view[self.n_vocab :] = -np.inf
            return
        if logits.device != allowed.device:
            allowed = allowed.to(logits.device, non_blocking=True)
        logits[..., :n].masked_fill_(~allowed[:n], float("-inf"))
        if logits.shape[-1] > self.n_vocab:
            logits[..., self.n_vocab :] = float("-inf")

    def is_allowed(self, token: int) -> bool:
        """Whether ``token`` may come next (cheap: checks one token, not the whole mask)."""
        if not 0 <= token < self.n_vocab:
            return False
        return self._matcher.validate_tokens([token]) == 1

    def accept(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            GrammarError: the grammar does not allow ``token`` here (a sampler bug, or a
                token that was not drawn from a masked distribution).
        """
        # Checked first so that a refused token leaves the matcher usable (llguidance's own
        # errors are sticky).
        if not self.is_allowed(token):
            raise GrammarError(f"{self.source}: token {token} is not allowed by the grammar here")
        if not self._matcher.consume_token(token):
            # An allowed token that fails: llguidance hit one of its limits while matching
            # (("a"{1000}){1000} builds too many lexer expressions on the first token).
            why = self._matcher.get_error() if self._matcher.is_error() else "refused"
            raise GrammarError(f"{self.source}: the grammar is too large to match: "
                               f"{_first_line(why.replace('<non-verbose/>', ''))}")

    def reset(self) -> None:
        """Back to the start of the grammar."""
        if self._matcher.is_error():  # errors are sticky in llguidance: start afresh
            self._matcher = llguidance.LLMatcher(self._lltok, self._grammar, log_level=0,
                                                 limits=_limits())
        else:
            self._matcher.reset()

    def is_accepting(self) -> bool:
        """True when the text so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """True when nothing but end-of-generation may follow (generation should stop)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def forced_bytes(self) -> bytes:
        """Bytes every continuation must start with (for diagnostics)."""
        return self._matcher.compute_ff_bytes()

    def _fed(self, data: bytes | str) -> llguidance.LLMatcher:
        data = data.encode("utf-8") if isinstance(data, str) else data
        matcher = self._matcher.deep_copy()
        matcher.reset()
        matcher.consume_tokens(self._lltok.tokenize_bytes(data))
        return matcher

    def matches(self, data: bytes | str) -> bool:
        """Whether the grammar accepts exactly ``data``; keeps no state (tests, diagnostics)."""
        matcher = self._fed(data)
        return not matcher.is_error() and matcher.is_accepting()

    def is_prefix(self, data: bytes | str) -> bool:
        """Whether ``data`` can be continued into a sentence of the grammar; keeps no state."""
        return not self._fed(data).is_error()


# ---- files, the CLI and the Python API ----------------------------------------------------
def resolve_grammar_file(name_or_path: str | Path) -> Path:
    """A GBNF file path, or the name of one in ``grammars/`` (``json`` or ``json.gbnf``).

    Raises:
        GrammarError: neither exists (the message lists the bundled grammars).
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path)
    for candidate in (GRAMMARS_DIR / name, GRAMMARS_DIR / f"{name}.gbnf"):
        if "/" not in name and candidate.is_file():
            return candidate
    available = ", ".join(sorted(p.stem for p in GRAMMARS_DIR.glob("*.gbnf")))
    raise GrammarError(
        f"--grammar-file: no file '{name}' and no bundled grammar of that name "
        f"(bundled: {available})"
    )


def load_grammar_file(name_or_path: str | Path, tokenizer: Any) -> GrammarConstraint:
    """:meth:`GrammarConstraint.from_gbnf` on a file found by :func:`resolve_grammar_file`."""
    path = resolve_grammar_file(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GrammarError(f"{path}: cannot read the grammar: {e}") from None
    return GrammarConstraint.from_gbnf(text, tokenizer, source=str(path))


def load_json_schema(value: str | Path) -> tuple[Any, str]:
    """The schema of ``--json-schema``: a file path, or the schema inline. Returns (schema, source).

    Raises:
        GrammarError: a file that is not JSON, or inline text that is not JSON.
    """
    text = str(value)
    path = Path(text).expanduser()
    if not text.lstrip().startswith(("{", "[")) and path.is_file():
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise GrammarError(f"{path}: cannot read the schema: {e}") from None
    elif text.lstrip().startswith(("{", "[")) or text.strip() in ("true", "false"):
        source = "--json-schema"
    else:
        raise GrammarError(f"--json-schema: '{text}' is neither a file nor inline JSON")
    return _loads(text, source), source


def _loads(text: str, source: str) -> Any:
    """``json.loads`` with every failure as a GrammarError (``source:line:col`` when known)."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{source}: the schema is longer than {MAX_SCHEMA_CHARS} characters")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{source}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except RecursionError:
        raise GrammarError(f"{source}: the schema is nested deeper than "
                           f"{MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as e:  # an integer literal beyond Python's digit limit
        raise GrammarError(f"{source}: not valid JSON: {_first_line(str(e))}") from None


def constraint_from_cli(
    grammar: str | None,
    grammar_file: str | None,
    json_flag: bool,
    json_schema: str | None,
    tokenizer: Any,
) -> GrammarConstraint | None:
    """The constraint of ``localllm run``'s --grammar / --grammar-file / --json / --json-schema.

    ``--json`` may be combined with ``--json-schema`` (the schema wins); otherwise at most
    one may be given. Returns None when none is.

    Raises:
        ParameterError: conflicting flags.
        GrammarError: the grammar or schema is invalid (the message has the location).
    """
    given = [f for f, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                            ("--json-schema", json_schema)) if v is not None]
    if json_flag and not json_schema:
        given.append("--json")
    if len(given) > 1:
        raise ParameterError(f"{' and '.join(given)} cannot be used together")
    if grammar is not None:
        return GrammarConstraint.from_gbnf(grammar, tokenizer, source="--grammar")
    if grammar_file is not None:
        return load_grammar_file(grammar_file, tokenizer)
    if json_schema is not None:
        schema, source = load_json_schema(json_schema)
        return GrammarConstraint.from_json_schema(schema, tokenizer, source=source)
    if json_flag:
        return GrammarConstraint.any_json(tokenizer)
    return None


def constraint_for(
    tokenizer: Any, *, grammar: str | None = None, json_schema: Any = None, json: bool = False
) -> GrammarConstraint | None:
    """The constraint for the Python API's ``grammar=`` / ``json_schema=`` / ``json=`` options.

    ``json_schema`` is a dict, or JSON text; ``grammar`` is GBNF text.
    """
    if grammar is not None and (json_schema is not None or json):
        raise ParameterError("grammar= and json_schema=/json= cannot be used together")
    if grammar is not None:
        return GrammarConstraint.from_gbnf(grammar, tokenizer, source="grammar=")
    if json_schema is not None:
        return GrammarConstraint.from_json_schema(json_schema, tokenizer, source="json_schema=")
    if json:
        return GrammarConstraint.any_json(tokenizer)
    return None


def generate_json(llm: Any, prompt: str | list[int], schema: Any = None, **kwargs: Any) -> Any:
    """Generate one JSON value (matching ``schema`` when given) and return it parsed.

    Args:
        llm: a :class:`localllm.LLM`.
        schema: a JSON schema (dict or JSON text); None for any JSON value.
        kwargs: passed to ``llm.stream`` (n_predict, seed, temp ...; n_predict defaults to 256).
    Raises:
        GrammarError: the schema is invalid.
        LocalLLMError: generation stopped (token limit, full context) before the value was
            complete.
    """
    constraint = (GrammarConstraint.any_json(llm.tokenizer) if schema is None
                  else GrammarConstraint.from_json_schema(schema, llm.tokenizer))
    kwargs.setdefault("n_predict", 256)
    pieces: list[str] = []
    finish = None
    for step in llm.stream(prompt, constraint=constraint, **kwargs):
        pieces.append(step.text)
        finish = step.finish_reason or finish
    text = "".join(pieces)
    if not constraint.is_accepting():
        raise LocalLLMError(
            f"generation ended ({finish}) before the JSON value was complete "
            f"({len(text)} characters; raise -n/n_predict)"
        )
    return json.loads(text)
