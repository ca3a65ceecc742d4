"""Stop strings across token boundaries (localllm.runtime.stop)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.runtime.stop import StopMatcher, cut_at_stop


def stream(pieces, stops):
    m = StopMatcher(stops)
    shown = []
    for p in pieces:
        text, stopped = m.push(p)
        shown.append(text)
        if stopped:
            return shown, True
    shown.append(m.flush())  # the end of the text can complete a stop that was held back
    return shown, m.stopped


def test_stop_split_over_tokens_is_never_shown():
    shown, stopped = stream(["Hello", " wor", "ld</", "ans", "wer> tail"], ["</answer>"])
    assert stopped
    assert "".join(shown) == "Hello world"
    # nothing of the stop string leaked out in any chunk
    assert all("<" not in s for s in shown)


def test_held_text_released_when_it_is_not_a_stop():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.held == "ST"
    assert m.push("ART") == ("START", False)
    assert m.flush() == ""


def test_partial_at_end_is_flushed():
    shown, stopped = stream(["x", "ST"], ["STOP"])
    assert not stopped and "".join(shown) == "xST"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["bbb", "ab"])
    out, stopped = m.push("xxabbbb")
    assert stopped and out == "xx" and m.matched == "ab"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_is_passthrough():
    m = StopMatcher([])
    assert m.push("<end>") == ("<end>", False)
    m = StopMatcher([""])
    assert m.push("abc") == ("abc", False)


def test_overlapping_prefix():
    # "aab" needs the held "aa" to be re-examined after a third "a"
    shown, stopped = stream(["a", "a", "a", "b", "c"], ["aab"])
    assert stopped and "".join(shown) == "a"


def test_reset_and_cut_helper():
    m = StopMatcher(["\n\n"])
    m.push("a\n\nb")
    assert m.stopped
    m.reset()
    assert m.push("c") == ("c", False)
    assert cut_at_stop("one\n\ntwo", ["\n\n"]) == ("one", True)
    assert cut_at_stop("one", ["\n\n"]) == ("one", False)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab<>/ \n", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/\n", min_size=1, max_size=5), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_split_matches_whole_text(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    shown, stopped = stream(pieces, stops)
    expect_cut = min((text.find(s) for s in stops if s in text), default=-1)
    if expect_cut >= 0:
        assert stopped and "".join(shown) == text[:expect_cut]
    else:
        assert not stopped and "".join(shown) == text
    # no chunk ever shows the beginning of a stop that later completed
    assert all(not any(s in piece for s in stops) for piece in shown)
