"""Stop strings matched across token boundaries, for streaming output.

A stop string may arrive split over several tokens (``"</"`` then ``"answer>"``). While
streaming, :class:`StopMatcher` holds back the tail of the text that could still be the
beginning of a stop string, releases it once it can no longer be, and drops it (with
everything after it) when the stop completes. llama.cpp does the same in
``tools/main/main.cpp`` / ``common`` (``find_partial_stop_string``); this is our own
implementation of the idea.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Streaming filter that cuts text at the first stop string.

    Args:
        stops: the stop strings; empty strings are ignored. With no stop strings every
            ``push`` returns its text unchanged.
    Attributes:
        stopped: True once a stop string has completed.
        matched: the stop string that completed (None before).
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text withheld because it may begin a stop string."""
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to show now, whether a stop string completed).

        When a stop completes, the returned text is everything before it and later pushes
        return ``("", True)``.
        """
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = self._first_match(buf)
        if cut >= 0:
            # A longer stop string that starts earlier may still be completing ('</<' while
            # '/' already matched): wait for it, as if the whole text had arrived at once.
            start = len(buf) - self._partial_len(buf)
            if start >= cut:
                self.stopped = True
                self._held = ""
                return buf[:cut], True
            self._held = buf[start:]
            return buf[:start], False
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _first_match(self, buf: str) -> int:
        """Index of the earliest complete stop string in ``buf`` (-1: none); sets ``matched``."""
        cut = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, self.matched = i, s
        return cut

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """End of text: release what was held back, cut at a stop string it completes."""
        held, self._held = ("" if self.stopped else self._held), ""
        cut = self._first_match(held)
        if cut >= 0:
            self.stopped = True
            return held[:cut]
        return held

    def reset(self) -> None:
        """Forget held text and the stopped state (for a new reply)."""
        self._held = ""
        self.stopped = False
        self.matched = None


def cut_at_stop(text: str, stops: Iterable[str]) -> tuple[str, bool]:
    """Non-streaming helper: ``text`` up to the first stop string, and whether one occurred."""
    m = StopMatcher(stops)
    out, _ = m.push(text)
    out += m.flush()  # the end of the text can complete a stop that push held back
    return out, m.stopped
