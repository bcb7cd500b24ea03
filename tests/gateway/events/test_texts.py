"""The text-prefix cache (`gateway.events.texts`): a long text that begins like one encoded
before takes that one's ids up to a cut they share and encodes only the rest, with exactly the
ids of encoding it whole; salted, bounded, and sampled against whole encodings."""

from __future__ import annotations

import array
import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.tokenizer import ModelTokenizer
from gateway.events import prompts
from gateway.events.prompts import PromptTokens
from gateway.events.texts import (
    OPENING_CHARS,
    TEXTS_PER_OPENING,
    TextIds,
    TextPrefixes,
    common_prefix,
)
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words

TOKENIZER = ModelTokenizer(MODEL_DIR)
FRAGMENTS = st.sampled_from(
    [" ", "  ", "   ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "a", "b", "é", "ß", "日本", "1",
     "23", ".", "...", ",", "'s", "🙂", "\x00", "\u200b", " word", " the", "x=1;", "<|im",
     "_start|", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "\n\n    "]
)  # fmt: skip
TEXTS = st.lists(FRAGMENTS, min_size=1, max_size=120).map("".join)


def small_cuts() -> PromptTokens:
    """Chunks of ~16 characters and every text of 32 or more through the cache: a few dozen
    characters exercise what a 50 kB prompt does at the defaults."""
    tokens = PromptTokens(TOKENIZER, chunk_chars=16, text_prefix_min_chars=32)
    assert tokens.chunking and tokens.text_prefixes
    return tokens


SHARED = small_cuts()
"""One instance for every example (its load-time probes are ~20 ms), each example its own salt."""


@settings(max_examples=300, deadline=None)
@given(TEXTS, st.data())
def test_a_continuation_has_the_ids_of_its_whole_encoding(text: str, data: st.DataObject) -> None:
    """A text, then a text sharing any prefix of it and going on with anything (added tokens,
    runs of whitespace, non-ASCII): each one's ids are the BPE's of it whole, whatever was
    reused. No sampled check runs, so nothing is corrected behind the comparison."""
    tokens = SHARED
    tokens._cut_count = 1  # the check comes due at multiples of `VERIFY_EVERY`: not in three
    salt = str(tokens.stats.segments)  # a new scope: nothing of an earlier example is found
    keep = data.draw(st.integers(0, len(text)))
    later = text[:keep] + data.draw(TEXTS)
    checks = tokens.stats.chunk_checks
    assert list(tokens.encode(text, salt)) == TOKENIZER.encode(text)
    assert list(tokens.encode(later, salt)) == TOKENIZER.encode(later)
    assert list(tokens.encode(later, salt)) == TOKENIZER.encode(later)  # itself, cached
    assert tokens.stats.chunk_checks == checks and tokens.chunking


def test_a_long_continuation_encodes_only_what_follows_its_last_shared_cut() -> None:
    """A 3,000-word text, then it with 100 more words: the second takes all but its last
    piece's ids from the cache and encodes a piece or two; the ids are the whole's."""
    tokens = PromptTokens(TOKENIZER, words=False)
    first = "Task:" + words("texts/first", 3_000)
    tokens.encode(first, "s")
    (entry,) = tokens.texts._entries["s", first[:OPENING_CHARS]]
    segments = tokens.stats.segments
    later = first + words("texts/more", 100)
    assert list(tokens.encode(later, "s")) == TOKENIZER.encode(later)
    assert tokens.stats.text_prefix_hits == 1
    assert tokens.stats.text_prefix_tokens >= entry.at[-2] > len(entry.ids) // 2
    assert tokens.stats.segments - segments <= 2  # the last shared chunk's rest, and the new


def test_tenants_share_no_text_prefix() -> None:
    """The same long text under another salt reuses nothing (nor under the first salt's
    opening in another tenant's scope)."""
    tokens = PromptTokens(TOKENIZER)
    text = words("texts/tenant", 3_000)
    tokens.encode(text, "tenant-a")
    tokens.encode(text + " more", "tenant-b")
    assert tokens.stats.text_prefix_hits == 0
    tokens.encode(text + " more", "tenant-a")
    assert tokens.stats.text_prefix_hits == 1


def test_the_text_prefix_cache_is_bounded() -> None:
    """Bytes held stay under the bound; the oldest openings go first."""
    tokens = PromptTokens(TOKENIZER, max_text_prefix_bytes=200_000)
    for i in range(12):
        tokens.encode(words(f"texts/bound{i}", 3_000), "s")
        assert tokens.texts.bytes <= 200_000
    tokens.encode(words("texts/bound11", 3_000) + " x", "s")
    tokens.encode(words("texts/bound0", 3_000) + " x", "s")
    assert tokens.stats.text_prefix_hits == 1  # the newest was kept, the first was dropped


def test_a_text_extending_an_entry_replaces_it_and_openings_keep_a_few() -> None:
    cache = TextPrefixes(margin=2, max_bytes=1 << 20)
    empty = array.array("q", [0])

    def entry(text: str) -> TextIds:
        return TextIds(text, array.array("I", [1]), empty, empty)

    opening = "x" * OPENING_CHARS
    cache.keep("s", entry(opening + "a"))
    cache.keep("s", entry(opening + "ab"))
    assert [e.text for e in cache._entries["s", opening]] == [opening + "ab"]
    for i in range(TEXTS_PER_OPENING + 3):
        cache.keep("s", entry(opening + f"-{i}"))
    kept = [e.text for e in cache._entries["s", opening]]
    assert kept == [opening + f"-{i}" for i in reversed(range(3, TEXTS_PER_OPENING + 3))]
    assert cache.bytes == sum(e.size for e in cache._entries["s", opening])


@settings(max_examples=300, deadline=None)
@given(st.text("ab", max_size=300), st.text("ab", max_size=300))
def test_common_prefix_is_the_longest_shared_beginning(a: str, b: str) -> None:
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    assert common_prefix(a, b) == (min(len(a), len(b)) if shared is None else shared)
    assert common_prefix(a, a + b) == len(a)


@pytest.mark.parametrize("at", [0, 1, 63, 64, 1_023, 1_024, 1_025, 3_000, 9_999])
def test_common_prefix_finds_a_difference_anywhere_in_a_long_text(at: int) -> None:
    text = words("texts/long", 2_000)[:10_000]
    other = text[:at] + "\x00" + text[at + 1 :]
    assert common_prefix(text, other) == common_prefix(other, text) == at
    assert common_prefix(text, other[:at]) == at


def test_a_wrong_splice_is_caught_by_the_sampled_check(caplog: pytest.LogCaptureFixture) -> None:
    """An entry whose ids are wrong (what a pre-tokenizer the probes missed would give) is
    caught where the continuation was spliced onto it: the check encodes the text around the
    splice whole, the whole text's ids are returned, and cutting goes off for good."""
    tokens = PromptTokens(TOKENIZER, words=False)
    text = words("texts/wrong", 3_000)
    tokens.encode(text, "s")
    (entry,) = tokens.texts._entries["s", text[:OPENING_CHARS]]
    middle = entry.at[len(entry.at) // 2]
    for i in range(middle, len(entry.ids)):
        entry.ids[i] = 7
    later = text + " and more"
    tokens._cut_count = 0  # the next cut text is a sampled one
    with caplog.at_level("WARNING"):
        got = tokens.encode(later, "s")
    assert list(got) == TOKENIZER.encode(later)
    assert tokens.stats.chunk_mismatches == 1 and not tokens.chunking
    assert tokens.texts.bytes == 0


def test_a_text_prefix_is_no_cut_when_less_than_its_margin_is_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two texts parting right after a cut of the first (a space, then another character)
    reuse only up to an earlier cut: whether a space is a cut depends on what follows it."""
    tokens = PromptTokens(TOKENIZER, chunk_chars=16, text_prefix_min_chars=32)
    monkeypatch.setattr(prompts, "VERIFY_EVERY", 1 << 30)
    tokens._cut_count = 1
    first = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    tokens.encode(first, "s")
    (entry,) = tokens.texts._entries["s", first[:OPENING_CHARS]]
    cut = entry.cuts[-1]
    later = first[: cut + 1] + "  x" + first[cut + 1 :]  # parts one character past the space
    assert list(tokens.encode(later, "s")) == TOKENIZER.encode(later)
    assert tokens.stats.text_prefix_tokens <= entry.at[-2]


def _novel(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(" " + "".join(rng.choices(string.ascii_lowercase, k=7)) for _ in range(n))


def test_a_segment_mostly_of_new_words_is_encoded_whole_unless_it_is_the_sampled_one() -> None:
    """Words no request used before cost the BPE plus a Python step each piece by piece: a
    segment mostly of them is encoded whole (one call, the same ids), and its words are not
    cached. The sampled check's text still goes through the word cuts it is there to test."""
    tokens = PromptTokens(TOKENIZER)
    tokens._cut_count = 1
    text = "Read:" + _novel(1, 300)
    assert list(tokens.encode(text, "s")) == TOKENIZER.encode(text)
    assert tokens.word_ids.stats.misses == 0 and tokens.word_ids.size == 0
    known = "Read:" + words("texts/known", 300)
    tokens.encode(known, "s")  # no word of it cached either: whole
    assert tokens.word_ids.stats.misses == 0
    tokens._cut_count = 0  # the next cut text is the sampled one
    sampled = "Read:" + _novel(2, 300)
    assert list(tokens.encode(sampled, "s")) == TOKENIZER.encode(sampled)
    assert tokens.word_ids.stats.misses > 250 and tokens.stats.chunk_checks == 1
    again = "Read:" + " ".join(reversed(_novel(2, 300).split(" ")))  # its words, reordered
    misses = tokens.word_ids.stats.misses
    assert list(tokens.encode(again, "s")) == TOKENIZER.encode(again)
    assert tokens.word_ids.stats.misses - misses <= 2  # word by word, from the cache


def test_interleaved_texts_that_open_alike_each_continue_from_their_own() -> None:
    """Ten long messages behind one shared opening (a system prompt), each then resent with
    more, turn by turn across them: each continuation reuses its own text, not just the
    opening (one entry per opening made them evict each other)."""
    tokens = PromptTokens(TOKENIZER, words=False)
    opening = words("texts/system", 1_000)
    texts = [opening + words(f"texts/own{i}", 1_000) for i in range(10)]
    for text in texts:
        tokens.encode(text, "s")
    reused = tokens.stats.text_prefix_tokens
    for i, text in enumerate(texts):
        later = text + words(f"texts/more{i}", 50)
        assert list(tokens.encode(later, "s")) == TOKENIZER.encode(later)
    own = len(TOKENIZER.encode(texts[0])) - len(TOKENIZER.encode(opening))
    assert tokens.stats.text_prefix_tokens - reused > 10 * (
        len(TOKENIZER.encode(opening)) + own // 2
    )
