"""GBNF (llama.cpp's grammar format) parsed, checked and translated to llguidance's Lark.

The syntax is the one ``llama.cpp/grammars/README.md`` documents: ``name ::= alternatives``
rules, ``root`` as the start rule, ``"literals"``, ``[character classes]`` with ranges and
``^`` negation, ``.`` (any character), ``( groups )`` that may span lines, ``|``, ``*`` ``+``
``?`` ``{m}`` ``{m,}`` ``{m,n}``, escapes ``\\xXX`` ``\\uXXXX`` ``\\UXXXXXXXX`` ``\\t``
``\\n`` ``\\r`` ``\\\\`` ``\\"`` ``\\[`` ``\\]``, ``#`` comments, and token references
``<[id]>`` / ``<token-text>`` (``!`` in front negates). Extensions: rule names may use
``_``, and a rule may continue on a line that starts with ``|``.

Everything llama.cpp rejects is rejected here before any matcher is built, with the
location as ``source:line:col``: syntax errors, undefined rules, a missing ``root``, left
recursion (llama.cpp's ``llama_grammar_detect_left_recursion`` does the same check), and,
to bound compile time and memory, nesting deeper than :data:`MAX_NESTING`, repetition
counts above :data:`MAX_REPEAT`, grammars whose expansion would exceed :data:`MAX_EXPANSION`,
chains of rule references longer than :data:`MAX_RULE_DEPTH`, and more than
:data:`MAX_GRAMMAR_CHARS` of text or :data:`MAX_ITEMS` items in all. Every check, and the
translation, takes time linear in the grammar's size (nullable rules are found by
propagation, not by a fixpoint over all rules), so a hostile grammar is refused in
milliseconds rather than minutes.

Translation: rules that are not recursive and use no token references are lexical (they
become Lark terminals, i.e. regular expressions); the rest stay context-free rules for
llguidance's Earley parser. Within a context-free rule, runs of consecutive lexical items
are merged into one terminal, because llguidance's lexer matches each terminal greedily
and two adjacent terminals (``[a-z]* "x"``) would otherwise lose GBNF's meaning.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import GrammarError

MAX_NESTING = 64  # parenthesised groups inside one another
MAX_REPEAT = 10_000  # largest m or n in {m,n}
MAX_EXPANSION = 1_000_000  # items a rule would have once repetitions are unrolled
MAX_RULES = 10_000
# Total work: the text, the items of all rules, and the items once repetitions are unrolled.
# llguidance's compile time grows with the number of items (about 10k per second here), so
# these keep any grammar's translation and compilation to about a second.
MAX_GRAMMAR_CHARS = 512 * 1024
MAX_ITEMS = 20_000  # the bundled grammars have at most 234
# Longest chain of rule references (root -> a -> b ...). llguidance walks such chains
# recursively and overflows its native stack (a segfault) somewhere near 2,000.
MAX_RULE_DEPTH = 500


# ---- AST ------------------------------------------------------------------------------------
@dataclass
class Node:
    pos: int


@dataclass
class Lit(Node):
    text: str


@dataclass
class Cls(Node):
    ranges: list[tuple[int, int]]
    negated: bool


@dataclass
class AnyChar(Node):
    pass


@dataclass
class Ref(Node):
    name: str


@dataclass
class Tok(Node):
    token: int | str  # an id (<[12]>) or a vocabulary piece (<think>)
    negated: bool


@dataclass
class Seq(Node):
    items: list[Node]


@dataclass
class Alt(Node):
    alts: list[Node]


@dataclass
class Rep(Node):
    node: Node
    lo: int
    hi: int | None  # None: unbounded


@dataclass
class Rule:
    name: str
    pos: int
    body: Node


@dataclass
class Grammar:
    """A parsed, checked GBNF grammar: rules by name, in definition order."""

    text: str
    source: str
    rules: dict[str, Rule] = field(default_factory=dict)

    def where(self, pos: int) -> str:
        """``source:line:col`` of character offset ``pos`` (both 1-based)."""
        return f"{self.source}:{location(self.text, pos)}"


def location(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"{line}:{col}"


# ---- parser ---------------------------------------------------------------------------------
_NAME = re.compile(r"[A-Za-z0-9_-]+")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]",
                   "-": "-", "^": "^", "/": "/"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.i = 0
        self.depth = 0

    def fail(self, message: str, pos: int | None = None) -> GrammarError:
        pos = self.i if pos is None else pos
        return GrammarError(f"{self.source}:{location(self.text, pos)}: {message}")

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def skip(self, newlines: bool) -> None:
        """Skip blanks and comments; newlines too when ``newlines``."""
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            else:
                break

    def parse(self) -> Grammar:
        grammar = Grammar(self.text, self.source)
        self.skip(newlines=True)
        while self.i < len(self.text):
            start = self.i
            m = _NAME.match(self.text, self.i)
            if not m:
                raise self.fail(f"expected a rule name, found {self.peek()!r}")
            name = m.group(0)
            self.i = m.end()
            self.skip(newlines=False)
            if not self.text.startswith("::=", self.i):
                raise self.fail(f"expected '::=' after rule name '{name}'")
            self.i += 3
            self.skip(newlines=True)
            body = self.alternatives(nested=False)
            if self.i < len(self.text) and self.peek() not in "\r\n":
                c = self.peek()
                what = "unmatched ')'" if c == ")" else f"unexpected character {c!r}"
                raise self.fail(what)
            if name in grammar.rules:
                raise self.fail(f"rule '{name}' is defined twice", start)
            grammar.rules[name] = Rule(name, start, body)
            if len(grammar.rules) > MAX_RULES:
                raise self.fail(f"more than {MAX_RULES} rules", start)
            self.skip(newlines=True)
        return grammar

    def alternatives(self, nested: bool) -> Node:
        pos = self.i
        alts = [self.sequence(nested)]
        while self.continues():
            self.i += 1
            self.skip(newlines=True)
            alts.append(self.sequence(nested))
        return alts[0] if len(alts) == 1 else Alt(pos, alts)

    def continues(self) -> bool:
        """At a '|' (an extension: also when a new line starts with one)."""
        if self.peek() == "|":
            return True
        save = self.i
        self.skip(newlines=True)
        if self.peek() == "|":
            return True
        self.i = save
        return False

    def sequence(self, nested: bool) -> Node:
        pos = self.i
        items: list[Node] = []
        while True:
            c = self.peek()
            if c == "" or c in "|)" or (c in "\r\n" and not nested):
                break
            item_pos = self.i
            if c == '"':
                item: Node = self.literal()
            elif c == "[":
                item = self.char_class()
            elif c == "(":
                item = self.group()
            elif c == ".":
                self.i += 1
                item = AnyChar(item_pos)
            elif c in "<!":
                item = self.token_ref()
            elif _NAME.match(c):
                m = _NAME.match(self.text, self.i)
                self.i = m.end()
                item = Ref(item_pos, m.group(0))
            elif c in "*+?{":
                raise self.fail(f"'{c}' must follow an item")
            else:
                raise self.fail(f"unexpected character {c!r}")
            self.skip(newlines=nested)
            item = self.repetition(item)
            items.append(item)
            self.skip(newlines=nested)
        if not items:
            return Lit(pos, "")
        return items[0] if len(items) == 1 else Seq(pos, items)

    def repetition(self, item: Node) -> Node:
        stacked = 0  # `"a"*?*...`: each operator nests the item once more
        while True:
            c, pos = self.peek(), self.i
            if c in ("*", "+", "?", "{") and c:
                stacked += 1
                if self.depth + stacked > MAX_NESTING:
                    raise self.fail(f"repetitions nested deeper than {MAX_NESTING}", pos)
            if c in ("*", "+", "?") and c:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{":
                self.i += 1
                self.skip(newlines=True)
                lo = self.integer()
                self.skip(newlines=True)
                hi = lo
                if self.peek() == ",":
                    self.i += 1
                    self.skip(newlines=True)
                    hi = self.integer() if self.peek().isdigit() else None
                    self.skip(newlines=True)
                if self.peek() != "}":
                    raise self.fail("expected '}' to close the repetition")
                self.i += 1
                if hi is not None and hi < lo:
                    raise self.fail(f"repetition {{{lo},{hi}}}: maximum is below minimum", pos)
                if max(lo, hi or 0) > MAX_REPEAT:
                    raise self.fail(f"repetition count above the limit of {MAX_REPEAT}", pos)
            else:
                return item
            item = Rep(pos, item, lo, hi)
            self.skip(newlines=False)

    def integer(self) -> int:
        m = re.compile(r"[0-9]+").match(self.text, self.i)
        if not m:
            raise self.fail("expected a number in the repetition")
        self.i = m.end()
        if len(m.group(0)) > 9:
            raise self.fail(f"repetition count above the limit of {MAX_REPEAT}", m.start())
        return int(m.group(0))

    def char(self, opening: int, what: str) -> str:
        """One possibly escaped character of a literal or class."""
        c = self.peek()
        if c == "" or c in "\r\n":
            raise self.fail(f"unterminated {what}", opening)
        if c != "\\":
            self.i += 1
            return c
        esc_pos = self.i
        e = self.text[self.i + 1] if self.i + 1 < len(self.text) else ""
        if e in _SIMPLE_ESCAPES:
            self.i += 2
            return _SIMPLE_ESCAPES[e]
        if e in _HEX_ESCAPES:
            n = _HEX_ESCAPES[e]
            digits = self.text[self.i + 2 : self.i + 2 + n]
            if len(digits) != n or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise self.fail(f"\\{e} needs {n} hex digits", esc_pos)
            value = int(digits, 16)
            if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                raise self.fail(f"\\{e}{digits} is not a Unicode scalar value", esc_pos)
            self.i += 2 + n
            return chr(value)
        if e == "" or e in "\r\n":
            raise self.fail(f"unterminated {what}", opening)
        raise self.fail(f"unknown escape '\\{e}'", esc_pos)

    def literal(self) -> Lit:
        start = self.i
        self.i += 1
        chars = []
        while self.peek() != '"':
            chars.append(self.char(start, "string"))
        self.i += 1
        return Lit(start, "".join(chars))

    def char_class(self) -> Cls:
        start = self.i
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            lo = self.char(start, "character class")
            hi = lo
            if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                range_pos = self.i
                self.i += 1
                hi = self.char(start, "character class")
                if ord(hi) < ord(lo):
                    raise self.fail(f"empty range {lo!r}-{hi!r} in character class", range_pos)
            ranges.append((ord(lo), ord(hi)))
        self.i += 1
        if not ranges:
            raise self.fail("empty character class", start)
        return Cls(start, ranges, negated)

    def group(self) -> Node:
        start = self.i
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.fail(f"groups nested deeper than {MAX_NESTING}", start)
        self.i += 1
        self.skip(newlines=True)
        body = self.alternatives(nested=True)
        if self.peek() != ")":
            raise self.fail("unclosed '(' (expected ')')", start)
        self.i += 1
        self.depth -= 1
        return body

    def token_ref(self) -> Tok:
        start = self.i
        negated = self.peek() == "!"
        if negated:
            self.i += 1
        if self.peek() != "<":
            raise self.fail("'!' must be followed by a token reference <...>")
        end = self.text.find(">", self.i)
        newline = self.text.find("\n", self.i)
        if end < 0 or (0 <= newline < end):
            raise self.fail("unterminated token reference (expected '>')", start)
        inner = self.text[self.i + 1 : end]
        self.i = end + 1
        m = re.fullmatch(r"\[([0-9]+)\]", inner)
        if m:
            return Tok(start, int(m.group(1)), negated)
        if not inner:
            raise self.fail("empty token reference", start)
        return Tok(start, "<" + inner + ">", negated)


# ---- checks ---------------------------------------------------------------------------------
def _walk(node: Node):
    yield node
    if isinstance(node, Seq):
        for item in node.items:
            yield from _walk(item)
    elif isinstance(node, Alt):
        for alt in node.alts:
            yield from _walk(alt)
    elif isinstance(node, Rep):
        yield from _walk(node.node)


def _children(node: Node) -> list[Node]:
    if isinstance(node, Seq):
        return node.items
    if isinstance(node, Alt):
        return node.alts
    if isinstance(node, Rep):
        return [node.node]
    return []


def _nullable_nodes(rules: dict[str, Rule]) -> set[int]:
    """ids of the nodes (rule bodies included) that can match the empty string.

    Linear in the grammar's size: each node becomes nullable at most once and then tells its
    parent (a sequence counts its non-nullable items down) or, for a rule body, every
    reference to the rule. The fixpoint over whole rules it replaces was quadratic in the
    length of a chain of nullable rules.
    """
    parent: dict[int, Node] = {}
    refs_to: dict[str, list[Ref]] = {name: [] for name in rules}
    pending: dict[int, int] = {}  # Seq id -> items not yet known nullable
    body_of: dict[int, str] = {}
    todo: list[Node] = []
    for rule in rules.values():
        body_of[id(rule.body)] = rule.name
        stack = [rule.body]
        while stack:
            node = stack.pop()
            kids = _children(node)
            for kid in kids:
                parent[id(kid)] = node
            stack.extend(kids)
            if isinstance(node, Seq):
                pending[id(node)] = len(node.items)
            elif isinstance(node, Ref):
                refs_to.setdefault(node.name, []).append(node)
            if (isinstance(node, Lit) and node.text == "") or (
                    isinstance(node, Rep) and node.lo == 0):
                todo.append(node)
    nullable: set[int] = set()
    done_rules: set[str] = set()
    while todo:
        node = todo.pop()
        if id(node) in nullable:
            continue
        nullable.add(id(node))
        name = body_of.get(id(node))
        if name is not None and name not in done_rules:
            done_rules.add(name)
            todo.extend(refs_to.get(name, ()))
        up = parent.get(id(node))
        if up is None:
            continue
        if isinstance(up, Seq):
            pending[id(up)] -= 1
            if pending[id(up)] == 0:
                todo.append(up)
        else:  # Alt: any alternative; Rep: its item
            todo.append(up)
    return nullable


def _first_refs(node: Node, nullable: set[int]) -> list[Ref]:
    """Rule references that can be the first thing ``node`` matches (``nullable``: ids of
    nullable nodes, from :func:`_nullable_nodes`)."""
    out: list[Ref] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Ref):
            out.append(n)
        elif isinstance(n, Seq):
            firsts = []
            for item in n.items:
                firsts.append(item)
                if id(item) not in nullable:
                    break
            stack.extend(reversed(firsts))
        elif isinstance(n, Alt):
            stack.extend(reversed(n.alts))
        elif isinstance(n, Rep):
            stack.append(n.node)
    return out


def _expansion(node: Node) -> int:
    """Items ``node`` would unroll to (repetitions multiplied out); rule refs count 1."""
    if isinstance(node, Seq):
        return sum(_expansion(i) for i in node.items)
    if isinstance(node, Alt):
        return sum(_expansion(a) for a in node.alts)
    if isinstance(node, Rep):
        inner = _expansion(node.node)
        count = max(node.lo, node.hi if node.hi is not None else node.lo + 1, 1)
        return min(inner * count, MAX_EXPANSION + 1)
    return 1


def check(grammar: Grammar) -> None:
    """Reject undefined rules, a missing root, left recursion and oversized rules.

    Raises:
        GrammarError: ``source:line:col: message`` for the first problem found.
    """
    rules = grammar.rules
    items = expanded = 0
    for rule in rules.values():
        for node in _walk(rule.body):
            items += 1
            if isinstance(node, Ref) and node.name not in rules:
                raise GrammarError(f"{grammar.where(node.pos)}: undefined rule '{node.name}'")
        if items > MAX_ITEMS:
            raise GrammarError(f"{grammar.where(rule.pos)}: the grammar has more than "
                               f"{MAX_ITEMS} items")
        expanded += _expansion(rule.body)
        if expanded > MAX_EXPANSION:
            raise GrammarError(
                f"{grammar.where(rule.pos)}: rule '{rule.name}' is too large once "
                f"repetitions are expanded (limit {MAX_EXPANSION} items in the grammar)"
            )
    if "root" not in rules:
        raise GrammarError(f"{grammar.source}: the grammar has no 'root' rule")

    nullable = _nullable_nodes(rules)

    # Depth-first search over "A can start with B" edges; a back edge is left recursion.
    # Iterative, so that a chain of thousands of rules cannot exhaust Python's stack.
    edges = {name: _first_refs(rule.body, nullable) for name, rule in rules.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in rules:
        if start in state:
            continue
        state[start] = 1
        path = [start]
        stack = [iter(edges[start])]
        while stack:
            ref = next(stack[-1], None)
            if ref is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(ref.name) == 1:
                cycle = path[path.index(ref.name):] + [ref.name]
                if len(cycle) > 8:  # keep the message one readable line
                    cycle = cycle[:4] + [f"... ({len(cycle) - 7} more)"] + cycle[-3:]
                raise GrammarError(
                    f"{grammar.where(ref.pos)}: left recursion: {' -> '.join(cycle)}"
                )
            if ref.name not in state:
                state[ref.name] = 1
                path.append(ref.name)
                stack.append(iter(edges[ref.name]))


def _check_depth(grammar: Grammar) -> None:
    """Reject a chain of more than :data:`MAX_RULE_DEPTH` rule references (recursive
    references, i.e. back edges, do not lengthen a chain). Iterative, like the search above."""
    refs = {name: [n for n in _walk(rule.body) if isinstance(n, Ref)]
            for name, rule in grammar.rules.items()}
    depth: dict[str, int] = {}
    on_stack: set[str] = set()
    for start in grammar.rules:
        if start in depth:
            continue
        stack = [(start, iter(refs[start]))]
        on_stack.add(start)
        best = {start: 1}
        while stack:
            name, it = stack[-1]
            ref = next(it, None)
            if ref is None:
                stack.pop()
                on_stack.discard(name)
                depth[name] = best[name]
                if stack:
                    parent = stack[-1][0]
                    best[parent] = max(best[parent], depth[name] + 1)
                continue
            if ref.name in on_stack:
                continue
            if ref.name in depth:
                best[name] = max(best[name], depth[ref.name] + 1)
            else:
                if len(stack) >= MAX_RULE_DEPTH:
                    raise GrammarError(
                        f"{grammar.where(ref.pos)}: rules nested deeper than {MAX_RULE_DEPTH} "
                        f"(a chain of references from '{start}')"
                    )
                on_stack.add(ref.name)
                best[ref.name] = 1
                stack.append((ref.name, iter(refs[ref.name])))
        if depth[start] > MAX_RULE_DEPTH:
            raise GrammarError(
                f"{grammar.where(grammar.rules[start].pos)}: rules nested deeper than "
                f"{MAX_RULE_DEPTH} (a chain of references from '{start}')"
            )


def parse_gbnf(text: str, source: str = "<grammar>") -> Grammar:
    """Parse and :func:`check` GBNF ``text``; ``source`` names it in error messages.

    Raises:
        GrammarError: syntax or semantic error, as ``source:line:col: message``.
    """
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{source}: the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
    grammar = _Parser(text, source).parse()
    check(grammar)
    _check_depth(grammar)
    return grammar


# ---- translation to Lark --------------------------------------------------------------------
def _rx_char(c: int) -> str:
    ch = chr(c)
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{c:X}}}"


def _rx_class(node: Cls) -> str:
    parts = [_rx_char(lo) if lo == hi else f"{_rx_char(lo)}-{_rx_char(hi)}"
             for lo, hi in node.ranges]
    return "/[" + ("^" if node.negated else "") + "".join(parts) + "]/"


def _lark_literal(text: str) -> str:
    if text == "":
        return '""'
    if all(" " <= c <= "~" and c not in '"\\' for c in text):
        return f'"{text}"'
    return "/" + "".join(_rx_char(ord(c)) for c in text) + "/"


class _Emitter:
    def __init__(self, grammar: Grammar, token_id: Callable[[str], int | None] | None) -> None:
        self.g = grammar
        self.token_id = token_id
        self.names: dict[str, str] = {}
        self.lexical: set[str] = set()
        self.out: list[str] = []
        self.n_anon = 0
        self._lexical_nodes: dict[int, bool] = {}

    def is_lexical(self, node: Node) -> bool:
        """No token reference, and only lexical rules referenced (memoized per node, once
        :meth:`classify` has settled the rules: the translation stays linear)."""
        known = self._lexical_nodes.get(id(node))
        if known is None:
            known = self._lexical_nodes[id(node)] = all(
                not isinstance(n, Tok) and (not isinstance(n, Ref) or n.name in self.lexical)
                for n in _walk(node)
            )
        return known

    def classify(self, reachable: list[str]) -> None:
        """Lexical rules: no token reference, and every referenced rule lexical (so never
        recursive). Linear: a rule is settled once its last non-lexical reference is."""
        users: dict[str, list[str]] = {name: [] for name in reachable}
        waiting: dict[str, int] = {}
        ready: list[str] = []
        for name in reachable:
            nodes = list(_walk(self.g.rules[name].body))
            if any(isinstance(n, Tok) for n in nodes):
                continue
            targets = {n.name for n in nodes if isinstance(n, Ref)}
            waiting[name] = len(targets)
            for t in targets:
                users[t].append(name)
            if not targets:
                ready.append(name)
        while ready:
            name = ready.pop()
            self.lexical.add(name)
            for user in users[name]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
        for i, name in enumerate(reachable):
            base = re.sub(r"[^A-Za-z0-9]", "_", name)
            lexical = name in self.lexical
            self.names[name] = f"T{i}_{base.upper()}" if lexical else f"r{i}_{base.lower()}"

    def expr(self, node: Node, lexical: bool) -> str:
        """Lark text of ``node``; in a context-free rule, lexical parts become terminals."""
        if not lexical and isinstance(node, Rep) and (node.lo, node.hi) == (0, 1):
            # `x?` stays optional in the parser rather than becoming a terminal that matches
            # the empty string: llguidance's Earley parser handles those poorly.
            inner = self.expr(node.node, False)
            return f"({inner})?" if isinstance(node.node, Rep) else f"{inner}?"
        if not lexical and self.is_lexical(node) and not isinstance(node, (Ref, Lit, Cls, AnyChar)):
            return self.anon_terminal(node)
        if isinstance(node, Lit):
            return _lark_literal(node.text)
        if isinstance(node, Cls):
            return _rx_class(node)
        if isinstance(node, AnyChar):
            return "/(?s:.)/"
        if isinstance(node, Ref):
            return self.names[node.name]
        if isinstance(node, Tok):
            return self.token(node)
        if isinstance(node, Alt):
            return "(" + " | ".join(self.expr(a, lexical) for a in node.alts) + ")"
        if isinstance(node, Rep):
            inner = self.expr(node.node, lexical)
            if isinstance(node.node, Rep) or (
                isinstance(node.node, (Seq, Alt)) and not inner.startswith("(")
            ):
                inner = f"({inner})"
            if (node.lo, node.hi) == (0, None):
                return inner + "*"
            if (node.lo, node.hi) == (1, None):
                return inner + "+"
            if (node.lo, node.hi) == (0, 1):
                return inner + "?"
            return inner + "{" + f"{node.lo}," + ("" if node.hi is None else str(node.hi)) + "}"
        assert isinstance(node, Seq)
        if lexical:
            return "(" + " ".join(self.expr(i, True) for i in node.items) + ")"
        parts: list[str] = []
        run: list[Node] = []
        for item in node.items + [None]:
            if item is not None and self.is_lexical(item):
                run.append(item)
                continue
            if len(run) == 1:
                parts.append(self.expr(run[0], False))
            elif run:
                parts.append(self.anon_terminal(Seq(run[0].pos, run)))
            run = []
            if item is not None:
                parts.append(self.expr(item, False))
        return "(" + " ".join(parts) + ")"

    def anon_terminal(self, node: Node) -> str:
        self.n_anon += 1
        name = f"X{self.n_anon}"
        self.out.append(f"{name}: {self.expr(node, True)}")
        return name

    def token(self, node: Tok) -> str:
        token = node.token
        if isinstance(token, str):
            found = self.token_id(token) if self.token_id is not None else None
            if found is None:
                raise GrammarError(
                    f"{self.g.where(node.pos)}: {token} is not a single token of the vocabulary"
                )
            token = found
        return f"<[^{token}]>" if node.negated else f"<[{token}]>"

    def emit(self) -> str:
        reachable: list[str] = []
        seen: set[str] = set()
        todo = ["root"]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            reachable.append(name)
            todo += [n.name for n in _walk(self.g.rules[name].body) if isinstance(n, Ref)]
        self.classify(reachable)
        lines = [f"start: {self.names['root']}"]
        for name in reachable:
            body = self.expr(self.g.rules[name].body, name in self.lexical)
            lines.append(f"{self.names[name]}: {body}")
        return "\n".join(lines + self.out) + "\n"


def gbnf_to_lark(
    text: str, source: str = "<grammar>", token_id: Callable[[str], int | None] | None = None
) -> str:
    """Translate GBNF ``text`` to llguidance's Lark dialect (after :func:`parse_gbnf`'s checks).

    Args:
        token_id: maps a ``<token-text>`` reference to its id (None: not a single token).
    Raises:
        GrammarError: any error :func:`parse_gbnf` raises, or an unknown ``<token>``.
    """
    return _Emitter(parse_gbnf(text, source), token_id).emit()
