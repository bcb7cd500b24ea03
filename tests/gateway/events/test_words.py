"""Word by word tokenization (`gateway.events.words`): the pieces' ids are the whole text's, the
cache is salted and bounded, and `PromptTokens` checks a sample and turns it off on a
difference."""

from __future__ import annotations

import array
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.tokenizer import ModelTokenizer
from gateway.events.prompts import PromptTokens, word_cuts
from gateway.events.words import WordIds, cuts, parts_of, rule_holds, split
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words
from tests.gateway.events.tokenizers import edited_tokenizer, merging_tokenizer

TOKENIZER = ModelTokenizer(MODEL_DIR)
CHARS = st.sampled_from(
    [" ", "  ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "a", "b", "é", "日本", "1", "23", ".", ",",
     "'s", "🙂", "\x00", "\u200b", " word", "x=1;", "<|im", "_start|"]
)  # fmt: skip
TEXTS = st.tuples(
    st.sampled_from(["", "<|im_start|>", "<|endoftext|>"]), st.lists(CHARS, max_size=40)
).map(lambda t: t[0] + "".join(t[1]))
"""What `WordIds` is given: a text with an added token at most at its start (a segment)."""


def ids_of(data: bytes) -> list[int]:
    out = array.array("I")
    out.frombytes(data)
    return list(out)


@settings(max_examples=400, deadline=None)
@given(TEXTS, st.booleans())
def test_a_text_is_cut_at_every_cut_of_its_rule_and_loses_nothing(text: str, loose: bool) -> None:
    """`split` cuts exactly where the rule's step-by-step definition does (`cuts`), the strict
    rule only where the chunking rule may (`word_cuts`: a space between two non-spaces), and
    the pieces join back to the text."""
    pieces = split(text, loose)
    assert "".join(pieces) == text
    at = [0]
    for piece in pieces[:-1]:
        at.append(at[-1] + len(piece))
    assert at[1:] == cuts(text, loose)
    if not loose:
        assert set(at[1:]) <= set(word_cuts(text, 0, len(text), 1))
    assert all(p[:1] == " " for p in pieces[1:])
    assert parts_of(text, loose)[1:] == [p[1:] for p in pieces[1:]]


ASCII_TEXTS = st.lists(
    st.sampled_from([" ", "  ", "a", "Zz", "1", ".", ",", "'s", "~", "!", " word", "x=1;", "\t"]),
    max_size=40,
).map("".join)
"""Mostly printable ASCII, where `parts_of` answers by C scans (`_every_space_cuts`) without
its regexes: the same cuts as the definition, under either rule."""


@settings(max_examples=400, deadline=None)
@given(ASCII_TEXTS, st.booleans())
def test_printable_ascii_is_cut_at_every_cut_of_its_rule(text: str, loose: bool) -> None:
    pieces = split(text, loose)
    assert "".join(pieces) == text
    at = list(itertools.accumulate(map(len, pieces[:-1])))
    assert at == cuts(text, loose)
    assert parts_of(text, loose)[1:] == [p[1:] for p in pieces[1:]]
    assert ids_of(WordIds(TOKENIZER.encode_pieces, loose=loose).ids(text, "s")) == (
        TOKENIZER.encode(text)
    )


def test_the_loose_rule_cuts_a_message_before_its_first_word_and_code_between_words() -> None:
    """What the loose rule adds (a space after whitespace, before a non-space, is a cut): a
    message's first word is a piece of its own, not glued to its role line; code is cut at
    its words, its indentation kept with the line before."""
    message = "<|im_start|>user\n Fix it"
    assert split(message, loose=False) == ["<|im_start|>user\n Fix", " it"]
    assert split(message, loose=True) == ["<|im_start|>user\n", " Fix", " it"]
    code = "\n    def f(x):\n        return  x"
    assert split(code, loose=True) == ["\n   ", " def", " f(x):\n       ", " return ", " x"]
    assert split(code, loose=False) == ["\n    def", " f(x):\n        return  x"]
    from gateway.events.prompts import _CHUNK_PROBES

    assert rule_holds(TOKENIZER.encode_many, _CHUNK_PROBES, loose=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(TEXTS, min_size=1, max_size=4), st.booleans())
def test_the_ids_word_by_word_are_the_whole_texts(texts: list[str], loose: bool) -> None:
    """Texts of every kind (runs of spaces, newlines, NBSP, CJK, emoji, added tokens) through
    one cache, so later texts hit pieces of earlier ones: each has the tokenizer's ids, under
    either rule."""
    cache = WordIds(TOKENIZER.encode_pieces, loose=loose)
    for text in texts:
        assert ids_of(cache.ids(text, "s")) == TOKENIZER.encode(text)


def test_a_turn_of_known_words_encodes_nothing_and_code_is_cut_too() -> None:
    cache = WordIds(TOKENIZER.encode_pieces)
    first = words("known", 300).strip()
    assert ids_of(cache.ids(first, "s")) == TOKENIZER.encode(first)
    misses = cache.stats.misses
    again = " ".join(reversed(first.split(" ")))  # the same words in another order
    assert ids_of(cache.ids(again, "s")) == TOKENIZER.encode(again)
    assert cache.stats.misses == misses + 1  # its first word, now without a space before it
    more = first.split(" ")[0] + " zqxjv " + first  # its first piece known, a later one new
    assert ids_of(cache.ids(more, "s")) == TOKENIZER.encode(more)
    assert cache.stats.misses == misses + 2
    code = "\n".join(f"    def f{i}(self, x):\n        return  x + {i}\n" for i in range(20))
    assert ids_of(cache.ids(code, "s")) == TOKENIZER.encode(code)
    assert len(parts_of(code)) > 40  # cut at the spaces between words, not only at lines


def test_tenants_share_no_word() -> None:
    """The same text under two salts: the second encodes every piece again (a hit is faster
    than a miss, so a shared entry would tell one tenant another's words)."""
    cache = WordIds(TOKENIZER.encode_pieces)
    text = words("salted", 200).strip()
    cache.ids(text, "salt-a")
    first = cache.stats.misses, cache.stats.tokens_encoded
    assert ids_of(cache.ids(text, "salt-b")) == TOKENIZER.encode(text)
    assert (cache.stats.misses, cache.stats.tokens_encoded) == (2 * first[0], 2 * first[1])
    cache.ids(text, "salt-a")
    assert cache.stats.misses == 2 * first[0]


def test_the_word_cache_is_bounded_and_stays_right() -> None:
    """A bound of 64 pieces: the young generation turns old at 32 and the old one is dropped,
    so at most 64 are held, and a text whose pieces were dropped is encoded again, right."""
    cache = WordIds(TOKENIZER.encode_pieces, max_pieces=64)
    texts = [words(f"bounded{i}", 50).strip() for i in range(10)]
    for _ in range(2):
        for text in texts:
            assert ids_of(cache.ids(text, "s")) == TOKENIZER.encode(text)
            assert 0 < cache.size <= 64
    with pytest.raises(ValueError, match="at least 2"):
        WordIds(TOKENIZER.encode_pieces, max_pieces=1)


def test_encoding_pieces_in_one_call_equals_one_call_each() -> None:
    """Joined by an added token and cut at its id: the same ids as encoding each alone, also
    for a text holding the separator itself (then each is encoded alone)."""
    texts = ["Hello", " world", "  ", "\n x", " <|im_start|>y", "", " 12 345"]
    assert TOKENIZER.encode_pieces(texts) == TOKENIZER.encode_many(texts)
    with_separator = [*texts, "a<|endoftext|>b"]
    assert TOKENIZER.encode_pieces(with_separator) == TOKENIZER.encode_many(with_separator)


def test_added_tokens_that_strip_spaces_turn_cutting_off(tmp_path: Any) -> None:
    def strip_after(spec: dict[str, Any]) -> None:
        for token in spec["added_tokens"]:
            token["rstrip"] = True  # eats the spaces after it: joining by it changes the ids

    tokenizer = edited_tokenizer(tmp_path, strip_after)
    texts = [" a", " b", "  c"]
    assert tokenizer._separator is None
    assert tokenizer.encode_pieces(texts) == tokenizer.encode_many(texts)
    # "<|im_end|> a" encodes as if the space were not there: no cutting at all with such tokens
    assert tokenizer.encode("<|im_end|> a") != tokenizer.encode("<|im_end|>") + tokenizer.encode(
        " a"
    )
    tokens = PromptTokens(tokenizer)
    assert not tokens.words and not tokens.chunking


def test_the_first_cut_text_and_every_64th_after_it_are_checked_whole() -> None:
    """Texts encoded through a cut are sampled: the first and every `VERIFY_EVERY`-th after
    it (the count once stopped after the first check, so only the first was ever checked)."""
    tokens = PromptTokens(TOKENIZER)
    assert tokens.words
    for i in range(65):
        tokens.encode(words(f"sampled{i}", 20).strip(), "s")
    assert tokens.stats.chunk_checks == 2 and tokens.stats.chunk_mismatches == 0


@pytest.mark.parametrize("size", [3, 60])
def test_a_difference_in_a_sampled_check_turns_word_cutting_off(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, size: int
) -> None:
    """A tokenizer whose BPE merges across spaces (no pre-tokenizer) fails the load-time
    probes; forced on anyway, the first sampled text's whole encoding differs: cutting goes
    off for good, the caches built from cut texts are dropped, and the ids are the whole's.
    A text of ~7 kB is checked on its first `CHECK_CHARS` only, and caught the same."""
    from gateway.events import prompts

    tokenizer = merging_tokenizer(tmp_path)
    assert not PromptTokens(tokenizer).words
    forced = PromptTokens(tokenizer)
    forced.chunking = forced.words = True
    monkeypatch.setattr(prompts, "VERIFY_EVERY", 2)
    messages = [{"role": "user", "content": prompts._CHUNK_PROBES[2] * size}]
    with caplog.at_level("WARNING"):
        forced.ids({"messages": messages}, chat=True, cache_salt="s")  # the first: checked
    whole = tokenizer.encode(tokenizer.render_chat(messages))
    assert list(forced.ids({"messages": messages}, chat=True, cache_salt="s")) == whole
    assert forced.stats.chunk_mismatches == 1 and not forced.words and not forced.chunking
    assert "cut at word boundaries differ" in caplog.text


def test_a_pre_tokenizer_that_keeps_a_run_of_whitespace_whole_gets_the_strict_rule(
    tmp_path: Any,
) -> None:
    """A pre-tokenizer splitting `\\s+` greedily (no `\\s+(?!\\S)`) gives "\\n" + " word" no
    cut between them ("\\n " is one piece): the loose rule's probes fail, the strict rule's
    pass, and the ids are still the whole's."""
    greedy = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }
    tokenizer = edited_tokenizer(tmp_path, lambda spec: spec.update(pre_tokenizer=greedy))
    tokens = PromptTokens(tokenizer)
    assert tokens.words and not tokens.word_ids.loose
    messages = [{"role": "user", "content": " Fix\n the  bug\n    in main.py"}]
    ids = tokens.ids({"messages": messages}, chat=True, cache_salt="s")
    assert list(ids) == tokenizer.encode(tokenizer.render_chat(messages))
    assert tokenizer.encode("\n word") != tokenizer.encode("\n") + tokenizer.encode(" word")


def test_a_big_texts_new_words_are_found_and_added_before_it_is_encoded() -> None:
    """What `PromptTokens.ids_off_loop` does for a big text: `missing` names each piece the
    cache lacks once (and nothing it holds), `add` keeps their ids, and the text then
    encodes with no miss, to the tokenizer's ids."""
    cache = WordIds(TOKENIZER.encode_pieces, loose=True)
    known = words("big-known", 200).strip()
    cache.ids(known, "s")
    new = words("big-new", 50).strip()
    text = known + " " + new + " " + known
    found = cache.missing([text, text], "s")
    expected = {" " + w for w in new.split(" ")} - {" " + w for w in known.split(" ")}
    assert set(found) == expected and len(found) == len(set(found))
    cache.add("s", found, TOKENIZER.encode_many(found))
    misses = cache.stats.misses
    assert ids_of(cache.ids(text, "s")) == TOKENIZER.encode(text)
    assert ids_of(cache.ids(text, "s")) == TOKENIZER.encode(text)  # its parts, cut again
    assert cache.stats.misses == misses


def test_a_big_text_all_known_is_looked_up_once_and_only_under_its_salt() -> None:
    """A chunk cut before a space (`word_cuts`) starts with one: it is cut at every later
    space as any other text, and `missing` of a text whose pieces are all cached keeps its
    ids for the `ids` that follows, under its salt only: another tenant's `ids` of the same
    text in between (the encoding awaits a thread) encodes its own pieces."""
    cache = WordIds(TOKENIZER.encode_pieces, loose=True)
    known = words("chunked", 300)  # " w1 w2 ...": a chunk after a cut
    assert known[0] == " " and parts_of(known, loose=True)[0] == " " + known.split(" ")[1]
    assert ids_of(cache.ids(known, "a")) == TOKENIZER.encode(known)
    misses = cache.stats.misses
    assert cache.missing([known], "a") == []
    assert ids_of(cache.ids(known, "b")) == TOKENIZER.encode(known)
    assert cache.stats.misses > misses  # b encoded its own words, a's kept ids unseen
    misses = cache.stats.misses
    assert ids_of(cache.ids(known, "a")) == TOKENIZER.encode(known)
    assert cache.stats.misses == misses
