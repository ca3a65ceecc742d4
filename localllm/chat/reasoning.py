"""Reasoning ("thinking") text: which markers a template family uses, whether a reply starts
inside a thinking block, and the text split into reasoning and content as it streams.

Families write their reasoning between markers that their chat template knows (llama.cpp's
``common/chat.cpp`` lists the same ones): ``<think>``/``</think>`` (Qwen3, QwQ, DeepSeek R1,
GLM 4.5+, SmolLM3, Kimi, MiniMax ...), ``[THINK]``/``[/THINK]`` (Magistral, Ministral
reasoning), ``<|START_THINKING|>``/``<|END_THINKING|>`` (Command R7B),
``<seed:think>``/``</seed:think>`` (Seed-OSS), ``<|inner_prefix|>``/``<|inner_suffix|>``
(Apertus); gpt-oss's harmony ``analysis`` channel is read by :mod:`localllm.chat.harmony`.

Whether a reply begins inside the block is read from the *generation prompt* (the text the
template adds for ``add_generation_prompt``, as llama.cpp computes it): DeepSeek R1's newer
template opens ``<think>\\n`` there, Qwen3's with ``enable_thinking=false`` writes an empty
``<think>\\n\\n</think>\\n\\n`` block, and Qwen3's default lets the model open it. Reasoning is
recognised at the start of a reply only (after whitespace); its leading and trailing
whitespace, and the whitespace between it and the content, are not part of either.

``--reasoning-format`` follows llama.cpp: ``none`` leaves the text unparsed in ``content``;
``deepseek`` (and ``auto``, the default) puts it in ``reasoning_content``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .events import Event

REASONING_FORMATS = ("none", "deepseek", "auto")
_WS = " \t\n\r"


@dataclass(frozen=True)
class ThinkingTags:
    """The markers around a family's reasoning text."""

    start: str
    end: str


# Most specific first: a template that knows "</seed:think>" also contains "</think>"-like
# text only as part of it.
_FAMILIES = (
    ThinkingTags("<seed:think>", "</seed:think>"),
    ThinkingTags("<|START_THINKING|>", "<|END_THINKING|>"),
    ThinkingTags("[THINK]", "[/THINK]"),
    ThinkingTags("<|inner_prefix|>", "<|inner_suffix|>"),
    ThinkingTags("<think>", "</think>"),
)


def thinking_tags(source: str) -> ThinkingTags | None:
    """The reasoning markers a chat template's source uses (its end marker appears in it:
    templates strip or write reasoning in the history), or None."""
    for tags in _FAMILIES:
        if tags.end in source:
            return tags
    return None


def generation_prompt(with_prompt: str, without_prompt: str) -> str:
    """The text a template adds for ``add_generation_prompt`` (what follows the common
    prefix of the two renderings), as llama.cpp's
    ``common_chat_template_generation_prompt`` computes it."""
    n = 0
    limit = min(len(with_prompt), len(without_prompt))
    while n < limit and with_prompt[n] == without_prompt[n]:
        n += 1
    return with_prompt[n:]


def opens_thinking(prompt_tail: str, tags: ThinkingTags) -> bool:
    """Whether ``prompt_tail`` (the generation prompt) leaves a thinking block open."""
    start = prompt_tail.rfind(tags.start)
    return start >= 0 and prompt_tail.find(tags.end, start) < 0


def check_reasoning_format(value: str) -> str:
    """``value`` if it is a known ``--reasoning-format``.

    Raises:
        ValueError: naming the known ones.
    """
    if value not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning format {value!r} (known: "
                         f"{', '.join(REASONING_FORMATS)})")
    return value


class ReasoningSplitter:
    """Splits a reply's text into ``reasoning`` and ``content`` events as it streams.

    Args:
        tags: the family's markers.
        inside: the reply begins inside a thinking block (the generation prompt opened it).
    Attributes:
        state: ``"start"`` (a block may still open), ``"thinking"``, ``"content"``.
        closed: the reasoning block was closed by its end marker.
    """

    def __init__(self, tags: ThinkingTags, *, inside: bool = False) -> None:
        self.tags = tags
        self.state = "thinking" if inside else "start"
        self.closed = False
        self._buf = ""
        self._lead = True  # at the start of the reasoning or of the content: drop whitespace
        self._held = ""  # trailing reasoning whitespace, released if more reasoning follows

    def push(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._buf:
            before = (self.state, len(self._buf))
            if self.state == "start":
                self._start(out)
            elif self.state == "thinking":
                self._thinking(out)
            else:
                self._text(out)
            if (self.state, len(self._buf)) == before:
                break  # waiting for more text
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.state == "thinking":
            self._reason(self._buf.rstrip(_WS), out)
        elif self._buf:
            self._text(out, final=True)
        self._buf = ""
        return out

    def _start(self, out: list[Event]) -> None:
        body = self._buf.lstrip(_WS)
        if body.startswith(self.tags.start):
            self._buf = body[len(self.tags.start):]
            self.state = "thinking"
        elif not self.tags.start.startswith(body):  # not the marker: content begins
            self.state = "content"
            self._lead = False

    def _thinking(self, out: list[Event]) -> None:
        end = self._buf.find(self.tags.end)
        if end >= 0:
            self._reason(self._buf[:end].rstrip(_WS), out)
            self._buf = self._buf[end + len(self.tags.end):]
            self._held = ""
            self.state = "content"
            self.closed = True
            self._lead = True
            return
        keep = _partial(self._buf, self.tags.end)
        piece = self._buf[:len(self._buf) - keep]
        body = piece.rstrip(_WS)
        self._reason(body, out)
        self._held += piece[len(body):]
        self._buf = self._buf[len(piece):]

    def _reason(self, text: str, out: list[Event]) -> None:
        if self._lead:
            text = text.lstrip(_WS)
            self._held = ""
        if not text:
            return
        self._lead = False
        out.append(Event("reasoning", self._held + text))
        self._held = ""

    def _text(self, out: list[Event], final: bool = False) -> None:
        text = self._buf
        if self._lead:
            text = text.lstrip(_WS)
            if not text and not final:
                self._buf = ""
                return
            self._lead = False
        self._buf = ""
        if text:
            out.append(Event("content", text))


def _partial(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


def single_token(tokenizer, text: str) -> int | None:
    """The id of ``text`` when the vocabulary has it as one token, else None."""
    ids = tokenizer.encode(text, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 else None


_HARMONY_FINAL = "<|channel|>final<|message|>"
_HARMONY_CALL = "<|channel|>commentary "


def thinking_control(tokenizer, fmt, inside: bool, budget: int = -1, *, call: bool = False):
    """How a reply's reasoning is run: a :class:`~localllm.grammar.lazy.Thinking` for a
    template of reply format ``fmt`` (:class:`~localllm.chat.replies.ChatFormat`) whose
    generation prompt opened the block (``inside``) or not, or None when it has no reasoning
    markers. ``budget``: reasoning tokens (-1: no limit). ``call``: the answer is a forced
    tool call (harmony: on the ``commentary`` channel, not ``final``)."""
    from ..grammar.lazy import Thinking

    tags = fmt.thinking
    if tags is None:
        return None
    if fmt.harmony:
        header = _HARMONY_CALL if call else _HARMONY_FINAL
        bridge = tuple(tokenizer.encode("<|start|>assistant" + header, add_bos=False,
                                        special=True))
        end = tuple(tokenizer.encode(tags.end, add_bos=False, special=True))
        return Thinking(end=tags.end, forced=end + bridge, inside=True, budget=budget,
                        bridge=bridge, skip=header)
    forced = tuple(tokenizer.encode(tags.end + "\n\n", add_bos=False, special=True))
    start = None if inside else single_token(tokenizer, tags.start)
    return Thinking(end=tags.end, forced=forced, start_token=start, inside=inside,
                    budget=budget)


__all__ = ["REASONING_FORMATS", "ReasoningSplitter", "ThinkingTags", "check_reasoning_format",
           "generation_prompt", "opens_thinking", "single_token", "thinking_control",
           "thinking_tags"]
