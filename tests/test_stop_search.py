"""The engine's stop-string check (elastic.control.requests.StopSearch): ``may_end`` decodes only the
output's last tokens, and ``find`` runs on the whole text only when a stop string can have appeared.
Against searching the whole text at every token, it must end every request at the same token and the
same place, and cost a bounded decode per token. The decode is a small pure one with a tokenizer's
artifacts at both ends of a text (a leading space dropped, a character of two byte tokens shown as
U+FFFD until both are there, tokens with no text)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.control.requests import StopSearch

PIECES = {0: "", 1: " ", 2: "a", 3: "b", 4: " ab", 5: "ba", 6: "\n", 7: "abab", 8: "  ", 9: "b a"}
LEAD, TRAIL = 90, 91  # a character's two bytes: "é" when LEAD is right before TRAIL, else U+FFFD each
VOCAB = [*PIECES, LEAD, TRAIL]


def decode(tokens: list[int]) -> str:
    out, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        if t == LEAD and i + 1 < len(tokens) and tokens[i + 1] == TRAIL:
            out.append("é")
            i += 2
            continue
        out.append("\ufffd" if t in (LEAD, TRAIL) else PIECES[t])
        i += 1
    text = "".join(out)
    return text[1:] if text.startswith(" ") else text  # as sentencepiece drops a text's first space


class Counted:
    def __init__(self) -> None:
        self.tokens_decoded = 0

    def __call__(self, tokens: list[int]) -> str:
        self.tokens_decoded += len(tokens)
        return decode(tokens)


def first_stop(tokens: list[int], stops: tuple[str, ...], min_tokens: int, gated: bool,
               count: Counted | None = None, step: int = 1) -> tuple[int, tuple[int, str]] | None:
    """As the engine appends (``step`` tokens at a time): (the token count, the hit) of the first hit, or None."""
    search, dec = StopSearch(stops, min_tokens), count or decode
    for n in [*range(step, len(tokens), step), len(tokens)]:
        seen = tokens[:n]
        if gated and not search.may_end(seen, dec):
            continue
        if not gated and n <= min_tokens:
            continue
        hit = search.find(dec(seen), seen, dec)
        if hit is not None:
            return n, hit
    return None


texts = st.lists(st.sampled_from(VOCAB), min_size=1, max_size=160)
stop_strings = st.lists(st.text(alphabet="ab \né", min_size=1, max_size=6), min_size=1, max_size=3).map(tuple)


@settings(max_examples=400, deadline=None)
@given(texts, stop_strings, st.integers(0, 12))
def test_a_request_ends_at_the_same_token_and_place_as_a_whole_text_search_at_every_token(tokens, stops, min_tokens):
    assert first_stop(tokens, stops, min_tokens, gated=True) == first_stop(tokens, stops, min_tokens, gated=False)


SHORT = [0, 1, 2, 3, 6, LEAD, TRAIL]  # pieces of at most one character: a stop string spans many tokens


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(SHORT), min_size=1, max_size=200), st.data(), st.integers(0, 12))
def test_a_stop_string_that_spans_many_tokens_is_found_at_the_same_token(tokens, data, min_tokens):
    text = decode(tokens)
    start = data.draw(st.integers(0, max(0, len(text) - 1)))
    stop = text[start:start + data.draw(st.integers(1, 24))] or "a"
    stops = (stop, data.draw(st.text(alphabet="ab \né", min_size=1, max_size=24)))
    assert first_stop(tokens, stops, min_tokens, gated=True) == first_stop(tokens, stops, min_tokens, gated=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(SHORT), min_size=1, max_size=300), st.data(), st.integers(0, 12), st.integers(1, 80))
def test_tokens_that_come_in_a_batch_are_searched_whole(tokens, data, min_tokens, step):
    """After a gap (a replay, tokens past a hole) the tail says nothing of what came before it."""
    text = decode(tokens)
    start = data.draw(st.integers(0, max(0, len(text) - 1)))
    stops = (text[start:start + data.draw(st.integers(1, 12))] or "a",)
    gated = first_stop(tokens, stops, min_tokens, gated=True, step=step)
    assert gated == first_stop(tokens, stops, min_tokens, gated=False, step=step)


def test_a_long_output_without_its_stop_string_costs_a_bounded_decode_per_token():
    tokens = [2, 3, 1, 6, 7, 9] * 700  # 4,200 tokens that never spell the stop string
    count = Counted()
    assert first_stop(tokens, ("abba",), 0, gated=True, count=count) is None
    assert count.tokens_decoded < 60 * len(tokens)  # a tail of a few dozen tokens, not the whole output
    whole = Counted()
    assert first_stop(tokens, ("abba",), 0, gated=False, count=whole) is None
    assert whole.tokens_decoded > 1000 * len(tokens)  # what it was: the whole output at every token


def test_a_stop_string_that_completes_a_character_made_of_two_tokens_is_found_when_the_second_comes():
    tokens = [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, LEAD, TRAIL, 2]
    assert first_stop(tokens, ("bé",), 0, gated=True) == (23, (20, "bé")) == first_stop(tokens, ("bé",), 0, gated=False)


def test_a_stop_string_in_a_batch_of_tokens_before_the_tail_ends_the_request():
    tokens = [2] * 60 + [3] + [2] * 139  # "b" at the 61st token; the first 40 came one by one, the rest at once
    search = StopSearch(("b",))
    answers = [search.may_end(tokens[:n], decode) for n in range(1, 41)]
    assert answers[0] and not any(answers[29:])  # the first call searches the whole text; later ones, a tail of "a"s
    assert search.may_end(tokens, decode) and search.find(decode(tokens), tokens, decode) == (60, "b")
