"""Grammar-constrained decoding: GBNF parsing and errors, bundled grammars, JSON schemas.

Fast tests run against a tiny byte-level tokenizer built here; the ``slow`` ones generate
with the default model and check every output with an independent parser (``json``,
``jsonschema``, gcc, and the small checkers below).
"""

from __future__ import annotations

import calendar
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jsonschema
import pytest
import torch

from localllm.errors import GrammarError, LocalLLMError, ParameterError
from localllm.grammar.constraint import (
    GRAMMARS_DIR,
    GrammarConstraint,
    constraint_for,
    constraint_from_cli,
    generate_json,
    lltokenizer,
    resolve_grammar_file,
)

DATA = Path(__file__).parent / "data" / "grammar"
SCHEMAS = json.loads((DATA / "schemas.json").read_text())


class ByteTokenizer:
    """A stand-in for localllm.tokenizer.Tokenizer: control tokens, the 256 bytes, a few merges."""

    CONTROLS: ClassVar[list[str]] = ["<bos>", "<eos>", "<|special|>", "<end_of_turn>"]
    MERGES: ClassVar[list[str]] = ["ab", '{"', '":', "true", " the", "\n\n", "12", "e4", "-0",
                                   "yes"]

    def __init__(self) -> None:
        n_ctl = len(self.CONTROLS)
        self.pieces = [b""] * n_ctl + [bytes([b]) for b in range(256)]
        self.pieces += [m.encode() for m in self.MERGES]
        self.n_vocab = len(self.pieces)
        self.bos_id, self.eos_id, self.add_bos = 0, 1, False
        self.eog_ids = frozenset({1, 3})

    def byte_id(self, b: int) -> int:
        return len(self.CONTROLS) + b

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]

    def token_text(self, i: int) -> str:
        return self.CONTROLS[i] if i < len(self.CONTROLS) else self.pieces[i].decode("latin-1")

    def is_control(self, i: int) -> bool:
        return i < len(self.CONTROLS)

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return [self.byte_id(b) for b in text.encode("utf-8")]

    def decode(self, ids, *, special: bool = False) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return ByteTokenizer()


# ---- independent checkers -------------------------------------------------------------------
def check_json_object(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except ValueError:
        return False


def check_json_array(s: str) -> bool:
    try:
        return isinstance(json.loads(s), list)
    except ValueError:
        return False


def check_number(s: str) -> bool:
    try:
        value = json.loads(s)
    except ValueError:
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool) and s == s.strip()


def check_arithmetic(s: str) -> bool:
    """Recursive descent over: expr = term ((+|-) term)*, term = factor ((*|/) factor)*."""
    pos = 0

    def sp() -> None:
        nonlocal pos
        if s[pos:pos + 1] == " ":
            pos += 1

    def factor() -> bool:
        nonlocal pos
        if s[pos:pos + 1] == "-":
            pos += 1
            return factor()
        if s[pos:pos + 1] == "(":
            pos += 1
            if not expr() or s[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        m = re.compile(r"[0-9]+(\.[0-9]+)?").match(s, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def chain(sub, ops: str) -> bool:
        nonlocal pos
        if not sub():
            return False
        while True:
            save = pos
            sp()
            if s[pos:pos + 1] and s[pos] in ops:
                pos += 1
                sp()
                if not sub():
                    return False
            else:
                pos = save
                return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(s)


_SAN = r"(O-O(-O)?|[KQRBN][a-h]?[1-8]?x?[a-h][1-8]|([a-h]x)?[a-h][1-8](=[QRBN])?)[+#]?"
_TURN = rf"[1-9][0-9]{{0,2}}\. {_SAN}( {_SAN})?"


def check_chess(s: str) -> bool:
    return re.fullmatch(rf"{_TURN}( {_TURN})*", s) is not None


def check_iso_date(s: str) -> bool:
    m = re.fullmatch(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", s)
    if not m:
        return False
    year, month, day = map(int, m.groups())
    if not 1 <= month <= 12:
        return False
    days = [31, 29 if calendar.isleap(year) else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= day <= days[month - 1]


def check_list(s: str) -> bool:
    return re.fullmatch(r"(- [^\n\r ][^\n\r]*\n)+", s) is not None


_C_SYNTAX_ERRORS = re.compile(
    r"error: (expected|stray|missing terminating|ISO C forbids an empty|return type defaults"
    r"|unterminated|type defaults)"
)


def check_c(s: str) -> bool:
    """gcc's parser on the program; semantic errors (undeclared names...) are not counted,
    since a grammar cannot know which names a program declares."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed")
    proc = subprocess.run([gcc, "-fsyntax-only", "-std=c99", "-pedantic-errors", "-x", "c", "-"],
                          input=s.encode(), capture_output=True, timeout=30, check=False)
    return _C_SYNTAX_ERRORS.search(proc.stderr.decode(errors="replace")) is None


CHECKERS = {
    "json": check_json_object,
    "json_arr": check_json_array,
    "number": check_number,
    "arithmetic": check_arithmetic,
    "chess": check_chess,
    "iso_date": check_iso_date,
    "list": check_list,
    "yes_no": lambda s: s in ("yes", "no", "Yes", "No"),
    "c": check_c,
}

C_OK = """#include <stdio.h>

int add(int a, int b) {
  return a + b;
}

int main(void) {
  int x = add(1, 2);
  char buf[16];
  if (x > 2 && x != 7) {
    printf("%d\\n", x);
  } else {
    x = 0;
  }
  for (int i = 0; i < 10; i++) {
    x += i * 2;
  }
  while (x) {
    x--;
  }
  return x;
}"""

CASES = {
    "json": (['{}', '{"a": 1}', '{"a": [1, 2.5, -3e10, "x\\n", true, null, {"b": {}}]}',
              '{ "k" : "v" , "k2":[ ] }', '{"u": "\\u00e9"}'],
             ['', '[]', '{"a": 01}', '{"a" 1}', '{a: 1}', '{"a": 1,}', '{"a": "\x01"}',
              '{"a": tru}', '{"a": 1} x']),
    "json_arr": (['[]', '[1, "a", {"b": [true]}]', '[{"name": "x"}, {"name": "y"}]'],
                 ['{}', '[1,]', '[', '1', '[01]']),
    "list": (['- a\n', '- first item\n- second one\n'], ['', '- \n', '* a\n', '- a', '-a\n']),
    "arithmetic": (['1', '1 + 2', '(1+2)*3', '-4 / (2 - 0.5)', '--1', '2*(3-(4/5))'],
                   ['', '1 +', '(1', '1 ++ 2', 'a', '1  + 2', '()', '1.']),
    "chess": (['1. e4', '1. e4 e5 2. Nf3 Nc6 3. Bb5 a6 4. O-O', '12. exd8=Q+ Kxd8', '1. O-O-O#',
               '7. Nbd2 R1e8'],
              ['', 'e4', '1. e9', '1. Zf3', '1.e4', '1. e4  e5', '0. e4']),
    "yes_no": (['yes', 'no', 'Yes', 'No'], ['', 'YES', 'yes.', 'maybe', ' yes']),
    "number": (['0', '-1', '3.14', '1e10', '-0.5E-3', '123456789'],
               ['', '01', '1.', '.5', '+1', '1e', '--1', '1 ']),
    "iso_date": (['2024-02-29', '2000-02-29', '2023-12-31', '1999-04-30', '0001-01-01'],
                 ['2023-02-29', '1900-02-29', '2023-04-31', '2023-13-01', '2023-1-01',
                  '2023-00-10', '2023-01-32', '2023-01-00']),
    "c": (['int main(void) {\n    return 0;\n}', C_OK],
          ['', 'int main() {', 'main(void) {\n}', 'int f(void) {\n  return 0\n}',
           'int f(void) {\n  x = ;\n}']),
}


def test_every_bundled_grammar_has_cases():
    assert {p.stem for p in GRAMMARS_DIR.glob("*.gbnf")} == set(CASES) == set(CHECKERS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bundled_grammar_accepts_and_rejects(tok, name):
    g = GrammarConstraint.from_gbnf(resolve_grammar_file(name).read_text(), tok, source=name)
    accept, reject = CASES[name]
    for s in accept:
        assert g.matches(s), f"{name} should accept {s!r}"
    for s in reject:
        assert not g.matches(s), f"{name} should reject {s!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkers_agree_with_cases(name):
    accept, reject = CASES[name]
    check = CHECKERS[name]
    assert all(check(s) for s in accept)
    assert not any(check(s) for s in reject)


# ---- GBNF features and errors ---------------------------------------------------------------
@pytest.mark.parametrize("text, accept, reject", [
    (r'root ::= "\x41\u00e9\U0001F600\t"', ["Aé😀\t"], ["A", "Ae😀\t"]),
    ('root ::= [^a-c0-9] [x-z]', ["dx", "%z"], ["ax", "5x", "dw"]),
    ('root ::= "a"{3}', ["aaa"], ["aa", "aaaa"]),
    ('root ::= "a"{2,}', ["aa", "aaaaa"], ["a"]),
    ('root ::= "a"{1,2} "b"?', ["a", "aab"], ["aaa", "b"]),
    ('root ::= "a"{ 0 , 1 }', ["", "a"], ["aa"]),
    ('root ::= . .', ["ab", "\n\n", "é!"], ["a"]),
    ('# comment\nroot ::= (  # inside\n  "a" |\n  "b"\n)+  # after\n', ["ab", "bba"], [""]),
    ('root ::= item+\nitem ::= [a-z]* "x"', ["abx", "xx", "abxcdx"], ["ab", ""]),
    ('root ::= a-b_c\na-b_c ::= "q"', ["q"], ["a"]),
    ('root ::= "x"\n     | "y"', ["x", "y"], ["xy"]),
    ('root ::= "(" root ")" | ""', ["", "(())"], ["(()"]),
    (r'root ::= [\]\[\\\-] "\""', ['-"', ']"', '\\"'], ['a"']),
])
def test_gbnf_features(tok, text, accept, reject):
    g = GrammarConstraint.from_gbnf(text, tok)
    for s in accept:
        assert g.matches(s), (text, s)
    for s in reject:
        assert not g.matches(s), (text, s)


def test_token_references(tok):
    special = 2  # <|special|>
    g = GrammarConstraint.from_gbnf('root ::= "a" <[2]> "b"', tok)
    assert g.is_allowed(tok.byte_id(ord("a")))
    g.accept(tok.byte_id(ord("a")))
    assert g.is_allowed(special) and not g.is_allowed(tok.byte_id(ord("b")))
    g.accept(special)
    g.accept(tok.byte_id(ord("b")))
    assert g.is_accepting()
    by_text = GrammarConstraint.from_gbnf('root ::= <|special|> "z"', tok)
    assert by_text.is_allowed(special)
    negated = GrammarConstraint.from_gbnf('root ::= !<[2]> "z"', tok)
    assert not negated.is_allowed(special) and negated.is_allowed(tok.byte_id(ord("q")))
    # Character classes never match control tokens.
    dot = GrammarConstraint.from_gbnf("root ::= .", tok)
    assert not dot.is_allowed(special) and dot.is_allowed(tok.byte_id(ord("q")))


@pytest.mark.parametrize("text, message", [
    ('root ::= foo', "g.gbnf:1:10: undefined rule 'foo'"),
    ('root ::= "a"\n\nitem ::= "b" bar', "g.gbnf:3:14: undefined rule 'bar'"),
    ('item ::= "a"', "g.gbnf: the grammar has no 'root' rule"),
    ('root ::= "a"\nx ::= "abc', "g.gbnf:2:7: unterminated string"),
    ('root ::= [a-z', "g.gbnf:1:10: unterminated character class"),
    ('root ::= x\nx ::= "a" | x "b"', "g.gbnf:2:13: left recursion: x -> x"),
    ('root ::= a\na ::= "q"? b "x"\nb ::= a', "g.gbnf:3:7: left recursion: a -> b -> a"),
    ('root ::= ("a"', "g.gbnf:1:10: unclosed '('"),
    ('root ::= "a")', "g.gbnf:1:13: unmatched ')'"),
    ('root ::= "a"{5,2}', "g.gbnf:1:13: repetition {5,2}: maximum is below minimum"),
    ('root ::= "a"{100001}', "g.gbnf:1:13: repetition count above the limit"),
    ('root ::= ' + "(" * 100 + '"a"' + ")" * 100, "g.gbnf:1:74: groups nested deeper than 64"),
    ('root ::= (("a"{1000}){1000}){1000}', "g.gbnf:1:1: rule 'root' is too large"),
    ('root ::= "\\q"', "g.gbnf:1:11: unknown escape '\\q'"),
    ('root ::= "\\x4g"', "g.gbnf:1:11: \\x needs 2 hex digits"),
    ('root ::= [z-a]', "g.gbnf:1:12: empty range"),
    ('root := "a"', "g.gbnf:1:6: expected '::='"),
    ('root ::= "a"\nroot ::= "b"', "g.gbnf:2:1: rule 'root' is defined twice"),
    ('root ::= <nope>', "g.gbnf:1:10: <nope> is not a single token"),
    ('root ::= * "a"', "g.gbnf:1:10: '*' must follow an item"),
    ('root ::= "a" @', "g.gbnf:1:14: unexpected character '@'"),
])
def test_gbnf_errors_name_line_and_column(tok, text, message):
    with pytest.raises(GrammarError) as info:
        GrammarConstraint.from_gbnf(text, tok, source="g.gbnf")
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_long_rule_chains_do_not_exhaust_the_stack(tok):
    def chain(n: int, last: str) -> str:
        rules = "\n".join(f'x{i} ::= x{i + 1} | x{i + 1} "b" | <[5]>' for i in range(n))
        return f"root ::= x0\n{rules}\nx{n} ::= {last}"

    g = GrammarConstraint.from_gbnf(chain(300, '"a"'), tok)
    assert g.is_allowed(tok.byte_id(ord("a")))
    # Deeper chains used to crash llguidance (a segfault near 2,000 levels).
    with pytest.raises(GrammarError, match=r"^g.gbnf:500:10: rules nested deeper than 500"):
        GrammarConstraint.from_gbnf(chain(3000, '"a"'), tok, source="g.gbnf")
    # The left-recursion search used to recurse once per rule (RecursionError).
    with pytest.raises(GrammarError) as info:
        GrammarConstraint.from_gbnf(chain(3000, "x0"), tok, source="g.gbnf")
    message = str(info.value)
    assert message.startswith("g.gbnf:3002:11: left recursion: x0 -> x1 -> x2 -> x3 -> ...")
    assert len(message) < 200


def test_stacked_repetition_operators(tok):
    # Thousands of postfix operators used to nest Rep nodes past Python's recursion limit.
    with pytest.raises(GrammarError, match=r"^g.gbnf:1:77: repetitions nested deeper than 64"):
        GrammarConstraint.from_gbnf('root ::= "a"' + "*" * 100000, tok, source="g.gbnf")
    # A few stacked operators are valid GBNF; they used to be emitted as Lark llguidance
    # cannot parse (`"a"**`).
    a, b = tok.byte_id(ord("a")), tok.byte_id(ord("b"))
    for text in ('root ::= "a"*+? "b"', 'root ::= (("a"*)*)* "b"', 'root ::= "a"{1,2}{1}? "b"'):
        g = GrammarConstraint.from_gbnf(text, tok)
        assert g.is_allowed(a) and g.is_allowed(b), text


# ---- the sampler-chain protocol -------------------------------------------------------------
def test_apply_masks_logits(tok):
    g = GrammarConstraint.from_gbnf('root ::= "ab" | "ac"', tok)
    logits = torch.zeros(tok.n_vocab + 7)  # a padded model output
    g.apply(logits)
    allowed = set(torch.nonzero(logits == 0).flatten().tolist())
    assert allowed == {tok.byte_id(ord("a")), tok.pieces.index(b"ab")}
    assert torch.isinf(logits[tok.n_vocab:]).all()
    short = torch.zeros(102)  # masked as far as it goes: only "a" (id 101) stays
    g.apply(short)
    assert torch.nonzero(short == 0).flatten().tolist() == [tok.byte_id(ord("a"))]


def test_eog_only_when_complete(tok):
    g = GrammarConstraint.from_gbnf('root ::= "a"+', tok)
    a = tok.byte_id(ord("a"))
    assert not g.is_allowed(tok.eos_id) and not g.is_accepting()
    g.accept(a)
    assert g.is_accepting() and not g.is_finished()
    assert g.is_allowed(tok.eos_id) and g.is_allowed(3)  # every end-of-generation id
    logits = torch.zeros(tok.n_vocab)
    g.apply(logits)
    assert logits[tok.eos_id] == 0 and logits[a] == 0
    with pytest.raises(GrammarError):
        g.accept(tok.byte_id(ord("b")))
    g.reset()
    assert not g.is_accepting() and g.is_allowed(a)


def test_finished_when_nothing_can_follow(tok):
    g = GrammarConstraint.from_gbnf('root ::= "yes" | "no"', tok)
    g.accept(tok.pieces.index(b"yes"))
    assert g.is_finished() and g.is_accepting()
    logits = torch.zeros(tok.n_vocab)
    g.apply(logits)
    assert set(torch.nonzero(logits == 0).flatten().tolist()) == {1, 3}


def test_masked_greedy_walk_yields_valid_json(tok):
    """Random logits, masked: whatever the argmax picks, the text is JSON at the end."""
    gen = torch.Generator().manual_seed(0)
    g = GrammarConstraint.from_gbnf(resolve_grammar_file("json").read_text(), tok)
    ids = []
    for _ in range(300):
        logits = torch.randn(tok.n_vocab, generator=gen)
        logits[tok.byte_id(ord("}"))] += 3.0  # make closing likely, so the walk ends
        g.apply(logits)
        token = int(torch.argmax(logits))
        if token in tok.eog_ids:
            break
        g.accept(token)
        ids.append(token)
    assert g.is_accepting()
    assert check_json_object(tok.decode(ids))


# ---- JSON schemas ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", SCHEMAS, ids=[c["name"] for c in SCHEMAS])
def test_json_schema_valid_and_invalid_instances(tok, case):
    g = GrammarConstraint.from_json_schema(case["schema"], tok)
    validator = jsonschema.Draft202012Validator(case["schema"],
                                                format_checker=jsonschema.FormatChecker())
    for value in case["valid"]:
        validator.validate(value)
        assert g.matches(json.dumps(value)), value
    for value in case["invalid"]:
        assert not validator.is_valid(value), value
        assert not g.matches(json.dumps(value)), value


def test_is_prefix(tok):
    g = GrammarConstraint.from_gbnf(resolve_grammar_file("json").read_text(), tok)
    assert g.is_prefix('{"a": [1, ') and not g.matches('{"a": [1, ')
    assert not g.is_prefix('{"a": ]')


def test_any_json_is_one_line(tok):
    g = GrammarConstraint.any_json(tok)
    for s in ['1', '"x"', 'null', '[1, 2]', '{"a": {"b": [true, false]}}']:
        assert g.matches(s), s
    for s in ['{"a":\n1}', ' 1', '[1,2]', '{']:
        assert not g.matches(s), s


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"items": {"$dynamicRef": "#x"}}}},
     "s.json: unsupported JSON-schema keyword '$dynamicRef' at /properties/a/items"),
    ({"unevaluatedProperties": False}, "s.json: unsupported JSON-schema keyword"),
    ('{\n  "type": "object",\n  "properties": }', "s.json:3:17: not valid JSON"),
    ("[1, 2]", "s.json: a JSON schema must be an object"),
    ({"type": "strin"}, "s.json: Invalid type: strin"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "s.json: Unsatisfiable schema"),
    ({"type": "string", "pattern": "[a-"}, "s.json: regex parse error"),
])
def test_json_schema_errors(tok, schema, message):
    with pytest.raises(GrammarError) as info:
        GrammarConstraint.from_json_schema(schema, tok, source="s.json")
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


# ---- files and flags ------------------------------------------------------------------------
def test_resolve_grammar_file(tmp_path):
    assert resolve_grammar_file("json") == GRAMMARS_DIR / "json.gbnf"
    assert resolve_grammar_file("chess.gbnf") == GRAMMARS_DIR / "chess.gbnf"
    own = tmp_path / "mine.gbnf"
    own.write_text('root ::= "x"')
    assert resolve_grammar_file(str(own)) == own
    with pytest.raises(GrammarError, match="no bundled grammar of that name.*json_arr"):
        resolve_grammar_file("nope")


def test_constraint_from_cli(tok, tmp_path):
    assert constraint_from_cli(None, None, False, None, tok) is None
    assert constraint_from_cli('root ::= "x"', None, False, None, tok).matches("x")
    assert constraint_from_cli(None, "yes_no", False, None, tok).matches("No")
    assert constraint_from_cli(None, None, True, None, tok).matches("[1]")
    inline = constraint_from_cli(None, None, True, '{"type": "integer"}', tok)
    assert inline.matches("12") and not inline.matches('"a"')
    schema = tmp_path / "s.json"
    schema.write_text('{"enum": ["a"]}')
    assert constraint_from_cli(None, None, False, str(schema), tok).matches('"a"')
    schema.write_text('{"enum": ["a"],\n "x" }')
    with pytest.raises(GrammarError, match=rf"^{re.escape(str(schema))}:2:6: not valid JSON"):
        constraint_from_cli(None, None, False, str(schema), tok)
    with pytest.raises(GrammarError, match="neither a file nor inline JSON"):
        constraint_from_cli(None, None, False, "missing.json", tok)
    with pytest.raises(GrammarError, match=r"^--grammar:1:10: undefined rule"):
        constraint_from_cli("root ::= x", None, False, None, tok)
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a"\nx ::= [a-')
    with pytest.raises(GrammarError, match=rf"^{re.escape(str(bad))}:2:7: unterminated"):
        constraint_from_cli(None, str(bad), False, None, tok)
    with pytest.raises(ParameterError, match="--grammar and --json"):
        constraint_from_cli('root ::= "x"', None, True, None, tok)
    with pytest.raises(ParameterError):
        constraint_for(tok, grammar='root ::= "x"', json=True)
    assert constraint_for(tok, json_schema={"type": "boolean"}).matches("true")


@dataclass
class _Step:
    token: int
    text: str
    finish_reason: str | None = None


class _ScriptedLLM:
    """Feeds a fixed text through the constraint, as LLM.stream would, then stops."""

    def __init__(self, tokenizer, text: str, finish: str) -> None:
        self.tokenizer, self.text, self.finish = tokenizer, text, finish

    def stream(self, prompt, *, constraint=None, n_predict=-1, **kw):
        ids = self.tokenizer.encode(self.text)
        for i, t in enumerate(ids):
            assert constraint.is_allowed(t)
            constraint.accept(t)
            last = i == len(ids) - 1
            yield _Step(t, self.tokenizer.decode([t]), self.finish if last else None)


def test_generate_json_parses_or_raises(tok):
    assert generate_json(_ScriptedLLM(tok, '{"a": [1, 2]}', "grammar"), "p") == {"a": [1, 2]}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert generate_json(_ScriptedLLM(tok, '{"n": 3}', "grammar"), "p", schema) == {"n": 3}
    with pytest.raises(LocalLLMError, match=r"generation ended \(length\) before the JSON"):
        generate_json(_ScriptedLLM(tok, '{"a": [1, ', "length"), "p")


# ---- real model -----------------------------------------------------------------------------
GEN_PROMPTS = {
    "json": "Describe a cat as a JSON object:",
    "json_arr": "A JSON array of three fruits:",
    "list": "Shopping list:\n",
    "arithmetic": "Write an arithmetic expression:",
    "chess": "The opening moves of a famous chess game:",
    "yes_no": "Is the sky blue? Answer:",
    "number": "The number of days in a year:",
    "iso_date": "The date of the first moon landing:",
    "c": "A C program that prints hello:\n",
}


def _generate(llm, prompt, constraint, n_predict, **sampling):
    steps = list(llm.stream(prompt, constraint=constraint, n_predict=n_predict, **sampling))
    return "".join(s.text for s in steps), steps[-1].finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GEN_PROMPTS))
def test_generation_follows_bundled_grammar(llm, name):
    text = resolve_grammar_file(name).read_text()
    g = GrammarConstraint.from_gbnf(text, llm.tokenizer, source=name)
    out, finish = _generate(llm, GEN_PROMPTS[name], g, 32, seed=1, temp=0.8)
    if finish == "length" and not g.is_accepting():
        # Cut by the token limit: every token was checked by accept(); a fresh matcher
        # must take the decoded text as a prefix too.
        fresh = GrammarConstraint.from_gbnf(text, llm.tokenizer, source=name)
        assert fresh.is_prefix(out), out
        return
    assert g.is_accepting(), (finish, out)
    assert CHECKERS[name](out), out


@pytest.mark.slow
def test_bundled_grammars_with_real_vocabulary(llm):
    """Masks over the 262k vocabulary stay within llguidance's limits on every accept case."""
    tokens = lltokenizer(llm.tokenizer)
    for name, (accept, _) in CASES.items():
        g = GrammarConstraint.from_gbnf(resolve_grammar_file(name).read_text(), llm.tokenizer)
        for s in accept:
            g.reset()
            for t in tokens.tokenize_bytes(s.encode()):
                assert g.allowed_mask()[t], (name, s)
                g.accept(t)
            assert g.is_accepting(), (name, s)


@pytest.mark.slow
def test_generation_follows_json_schemas(llm):
    completed = 0
    for i, case in enumerate(SCHEMAS):
        g = GrammarConstraint.from_json_schema(case["schema"], llm.tokenizer)
        prompt = f"Output JSON for {case['name'].replace('_', ' ')}:"
        out, finish = _generate(llm, prompt, g, 32, seed=i, temp=0.7)
        if finish == "length" and not g.is_accepting():
            continue
        completed += 1
        jsonschema.validate(json.loads(out), case["schema"],
                            format_checker=jsonschema.FormatChecker())
    assert completed >= len(SCHEMAS) // 2


SAMPLER_SETTINGS = [
    {"temp": 0.0},
    {"temp": 1.0, "top_k": 5},
    {"temp": 1.0, "top_p": 0.5},
    {"temp": 1.0, "min_p": 0.1},
    {"temp": 1.0, "typ_p": 0.5},
    {"temp": 1.0, "top_n_sigma": 1.0},
    {"temp": 1.5, "xtc_probability": 0.5, "xtc_threshold": 0.1},
    {"temp": 1.0, "penalty_repeat": 1.3, "penalty_present": 0.5, "penalty_freq": 0.5},
    {"temp": 1.0, "dry_multiplier": 0.8},
    {"temp": 1.0, "mirostat": 1, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
    {"temp": 1.0, "mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
]


@pytest.mark.slow
@pytest.mark.parametrize("settings", SAMPLER_SETTINGS,
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_grammar_with_each_sampler(llm, settings):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    g = GrammarConstraint.from_json_schema(schema, llm.tokenizer)
    out, finish = _generate(llm, "A person as JSON:", g, 32, seed=7, **settings)
    assert finish in ("grammar", "eog"), (finish, out)
    jsonschema.validate(json.loads(out), schema)


@pytest.mark.slow
def test_generate_json_with_model(llm):
    value = generate_json(llm, "A JSON list of two colors:",
                          {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                           "minItems": 2, "maxItems": 2}, n_predict=32, seed=3)
    assert isinstance(value, list) and len(value) == 2
    # The smallest value (27 tokens) does not fit in 8: generation stops short.
    with pytest.raises(LocalLLMError, match="before the JSON value was complete"):
        generate_json(llm, "A long JSON string:", {"type": "string", "minLength": 200},
                      n_predict=8, seed=3)
    # Nor in 4 tokens of any tokenization (48 bytes at most each): refused before generating.
    with pytest.raises(GrammarError, match=r"\(minLength 200 at /\) cannot fit in 4 tokens"):
        generate_json(llm, "A long JSON string:", {"type": "string", "minLength": 200},
                      n_predict=4, seed=3)
