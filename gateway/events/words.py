"""Token ids word by word: a text cut right before the spaces where its tokenizer always starts
a new piece, each piece's ids from a salted cache.

A GPT-2-style byte-level pre-tokenizer (` ?\\p{L}+`, ` ?\\p{N}+`, `\\s+(?!\\S)`, ...) starts a new
piece at a space that precedes a non-space, so the ids of the pieces encoded one by one
concatenate to the ids of the whole. Two rules, each on only when probes of every kind of
text say so (`rule_holds`; `PromptTokens` also compares a sample with the whole encoding):

- strict: a space between two non-spaces is a cut (any pattern whose pieces never cross a
  space and start with their optional leading space);
- loose: also a space after whitespace, when a non-space follows it (`\\s+(?!\\S)` leaves the
  last space of a run to the word after it: "\\n    def" is "\\n   " + " def"), so a message's
  first word is its own piece and code is cut between its words, not only at its lines.

What it saves: `tokenizers` spends ~1.3 µs a token on this machine encoding a chat turn,
nearly all of it the per-call pipeline (normalise, pre-tokenize, offsets, the `Encoding`
object), since it caches the BPE of each word already; a dict lookup per word is ~30 ns.

    text ──split(" ")──▶ parts ──glued across every space that is no cut──▶ parts
         parts[0]: a first piece;  parts[i > 0]: the piece " " + parts[i], keyed by parts[i]
    pieces ──young generation (C loop), else old (promoted), else the BPE (one call for all
         the text's misses)──▶ ids as native uint32 bytes ──b"".join──▶ the text's ids

A text may hold an added token only at its start (`PromptTokens` cuts its renderings before
every one): the tokenizer splits its input at added tokens before pre-tokenizing, so a space
right before one ends the text before it, where the loose rule's backtracking does not apply.

A character that is not `_GOOD` beside a space (whitespace, anything unprintable, the NUL that
stands for an empty part) keeps it from being a cut. Gluing across a space is always safe (the
text uncut is the reference); it only makes that piece less likely to be cached.

The cache is keyed under the request's cache salt like the other tokenization caches: a
tenant neither reads nor times another's words. It is bounded in pieces and generational:
when the young generation holds half the bound it becomes the old one and the previous old
one is dropped, so a hit costs one dict lookup in a C loop and nothing else (no LRU
bookkeeping). Where the compiled module is built, each salt's pieces in the young generation
(later and first) are mirrored in a `cachemap._native.WordTable` as they are kept: a text
every space of which is a cut is looked up from its characters in one call (`_whole`), no
`str` made, hashed and compared a word (bench point 2's prompts: 1.3 -> 0.5 ms a request);
any piece it lacks sends the text the pure way, which is the definition.
"""

from __future__ import annotations

import array
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from cachemap.native import NATIVE

DEFAULT_WORD_CACHE_PIECES = 262_144
"""Pieces kept (both generations, every salt): ~34 MB at ~130 bytes an entry (the key, a
`bytes` of 1-3 ids, the dict slot), and up to ~17 MB more for the compiled mirror of the young
generation (64-byte slots, at most 3/4 full); English prose uses ~20k distinct words, a code
base more."""

_GOOD = (
    "!-~\u00a1-\u167f\u1681-\u1fff\u2010-\u2027\u2030-\u205e\u2065-\u2fff"
    "\u3001-\ufefe\uff00-\U0010ffff"
)
"""Characters a cut may stand beside: printable ASCII but the space, and every other character
but whitespace (the tokenizers' Unicode White_Space), the format characters around it, the
byte-order mark and control characters."""
_BAD = re.compile(f"[^{_GOOD}]")
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))
_SPACE_BEFORE_BAD = re.compile(f" (?![{_GOOD}])")
"""A space no cut under either rule: before a character that is not `_GOOD`, another space or
the text's end. A literal first, so the scan is a memchr for each space."""
_BAD_BEFORE_SPACE = re.compile(f"[^{_GOOD}] ")
"""A space no cut under the strict rule: after a character that is not `_GOOD`."""
PIECE_STRICT = re.compile(f" ?(?:[^ ]+| (?![{_GOOD}])|(?<![{_GOOD}]) )*")
"""A piece under the strict rule: an optional leading space (a cut), then runs without a space
and spaces that are no cut (not between two good characters). `findall` also matches "" at
the end."""
PIECE_LOOSE = re.compile(f" ?(?:[^ ]+| (?![{_GOOD}]))*")
"""A piece under the loose rule: a space is a cut wherever a good character follows it."""
MOSTLY_NEW_PARTS = 16
"""`whole_when_new`: a text of at least this many pieces, more than half of them in neither
generation, is left to the caller to encode whole (`ids_or_none`, `missing_or_whole`)."""
GLUE_AT_MOST = 8
"""More than one space in this many is no cut: the text is cut by the pattern (one C pass)
instead of gluing its parts a run at a time."""

_first = itemgetter(0)
_last = itemgetter(-1)

Encoder = Callable[[Sequence[str]], list[list[int]]]
"""Token ids of each text, in one call (`ModelTokenizer.encode_pieces`)."""


@dataclass
class WordStats:
    pieces: int = 0
    misses: int = 0
    """Pieces encoded (what the BPE really saw), each once."""
    tokens_encoded: int = 0


def parts_of(text: str, loose: bool = False) -> list[str]:
    """`text` cut at every cut of its rule (module docstring): the first piece, then each
    later piece without its leading space."""
    parts = text.split(" ")
    if len(parts) == 1:
        return parts
    if _every_space_cuts(text) or (
        _SPACE_BEFORE_BAD.search(text) is None and (loose or _BAD_BEFORE_SPACE.search(text) is None)
    ):
        # every space is a cut but one opening the text (a chunk cut before a space starts
        # so): a regex scan, not a Python step a part (py-spy)
        if not parts[0]:
            parts[0:2] = [" " + parts[1]]
        return parts
    empty = parts.count("")
    if empty * GLUE_AT_MOST > len(parts):  # runs of spaces (code's indentation)
        return _by_pattern(text, loose)
    probe = parts if not empty else [p or "\x00" for p in parts]
    firsts = "".join(map(_first, probe[1:]))
    lasts = "" if loose else "".join(map(_last, probe[:-1]))
    bad = {m.start() for m in _BAD.finditer(firsts)}
    if not loose:
        bad.update(m.start() for m in _BAD.finditer(lasts))
    if not parts[0]:
        bad.add(0)  # a space opening the text is no cut
    if len(bad) * GLUE_AT_MOST > len(parts):
        return _by_pattern(text, loose)
    out: list[str] = []
    done = 0  # parts[:done] are in out
    for start, end in _runs(sorted(bad)):  # boundaries start..end glue parts[start : end + 2]
        out.extend(parts[done:start])
        out.append(" ".join(parts[start : end + 2]))
        done = end + 2
    out.extend(parts[done:])
    return out


def _every_space_cuts(text: str) -> bool:
    """Whether every space of `text` is a cut under either rule (but one opening it), by C
    scans that step no regex per space: printable ASCII (every character but the space is
    `_GOOD`), no two spaces in a row, none at the end. A prompt of words (bench point 2's) is
    so; the regexes answer the rest (each was a regex step a space: ~15% of keying such a
    text, py-spy)."""
    return (
        text.isascii()
        and not text.encode("ascii").translate(None, _PRINTABLE_ASCII)  # isprintable: 17x slower
        and "  " not in text
        and text[-1:] != " "
    )


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as runs of consecutive ones, (first, last)."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p - 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def _by_pattern(text: str, loose: bool) -> list[str]:
    """`parts_of` by one regex pass: cheaper where many spaces are no cut."""
    found = (PIECE_LOOSE if loose else PIECE_STRICT).findall(text)
    if found and not found[-1]:
        found.pop()
    return [found[0], *(p[1:] for p in found[1:])] if found else [text]


def split(text: str, loose: bool = False) -> list[str]:
    """`text`'s pieces as texts (each later piece with its leading space)."""
    parts = parts_of(text, loose)
    return [parts[0], *(" " + p for p in parts[1:])]


def cuts(text: str, loose: bool) -> list[int]:
    """Every cut of `text` under a rule, by its definition, a step per character: what `split`
    must agree with, and where the probes are cut."""
    good = re.compile(f"[{_GOOD}]")
    return [
        i
        for i in range(1, len(text) - 1)
        if text[i] == " " and good.match(text[i + 1]) and (loose or good.match(text[i - 1]))
    ]


def rule_holds(encode_many: Encoder, probes: Sequence[str], loose: bool) -> bool:
    """Whether every probe has a cut under the rule, and its ids cut at every one of them and
    encoded piece by piece are its ids encoded whole."""
    for probe in probes:
        bounds = [0, *cuts(probe, loose), len(probe)]
        if len(bounds) < 3:
            return False
        pieces = [probe[a:b] for a, b in itertools.pairwise(bounds)]
        joined = [i for ids in encode_many(pieces) for i in ids]
        if joined != encode_many([probe])[0]:
            return False
    return True


def _all_young(later: dict[str, bytes], head: bytes | None, parts: list[str]) -> bytes | None:
    """The ids of `parts` when its first piece's are `head` and every later piece is in the
    young generation's `later`: one C loop, no list to test for gaps; else None."""
    if head is None:
        return None
    try:
        return head + b"".join(map(later.get, itertools.islice(parts, 1, None)))  # type: ignore[arg-type]
    except TypeError:  # a None: a piece the young generation lacks
        return None


_WORD_TABLE: Any = NATIVE.WordTable if NATIVE is not None else None
"""`cachemap._native.WordTable`, where it is built: a mirror of a salt's pieces in the
young generation that looks a text's pieces up from its characters (`_tail`)."""


def _tail(
    table: dict[str, bytes], text: str, first: dict[str, bytes] | None = None
) -> tuple[int, bytes, int] | None:
    """`WordTable.tail`'s definition, on a young generation's later pieces `table` and first
    pieces `first` (dicts): for a text every space of which is a cut (`_every_space_cuts`) of
    two pieces or more, each later piece in `table`: (where its first piece ends, the later
    pieces' ids joined, its pieces), or (0, every piece's ids joined, its pieces) when its
    first piece is kept too (in `first`; in `table` after its space when it opens with one);
    else None. What `parts_of` and `_all_young` give such a text."""
    if not text or not _every_space_cuts(text):
        return None
    parts = parts_of(text)
    if len(parts) < 2:
        return None
    try:
        rest = b"".join(map(table.get, parts[1:]))  # type: ignore[arg-type]
    except TypeError:  # a None: a piece the table lacks
        return None
    head = parts[0]
    found = table.get(head[1:]) if head[:1] == " " else (first or {}).get(head)
    return (len(head), rest, len(parts)) if found is None else (0, found + rest, len(parts))


class _Generation:
    """One generation of the cache: per salt, (later pieces by their text after the space,
    first pieces by their text), and, where the compiled module is built, both kinds'
    `WordTable` (`tables`: written with them while the generation is the young one)."""

    def __init__(self, table: Callable[[], Any] | None) -> None:
        self.salts: dict[str, tuple[dict[str, bytes], dict[str, bytes]]] = {}
        self.table = table
        self.tables: dict[str, Any] = {}
        self.size = 0

    def of(self, salt: str) -> tuple[dict[str, bytes], dict[str, bytes]]:
        maps = self.salts.get(salt)
        if maps is None:
            maps = self.salts[salt] = ({}, {})
            if self.table is not None:
                self.tables[salt] = self.table()
        return maps


class WordIds:
    """A text's ids piece by piece through the salted, generational word cache (module
    docstring). `ids` returns native uint32 bytes; `missing` and `add` let a caller encode a
    big text's new pieces off the event loop first."""

    def __init__(
        self,
        encode: Encoder,
        max_pieces: int = DEFAULT_WORD_CACHE_PIECES,
        loose: bool = False,
        table: Callable[[], Any] | None = _WORD_TABLE,
    ) -> None:
        if max_pieces < 2:
            raise ValueError(f"max_pieces must be at least 2, got {max_pieces}")
        self.encode_many = encode
        self.loose = loose
        """The loose rule (module docstring), else the strict one."""
        self.max_pieces = max_pieces
        self.stats = WordStats()
        self.table = table
        """What mirrors each salt's pieces in the young generation (`WordTable`), or
        None: the compiled module's where it is built; the tests set both."""
        self._young = _Generation(table)
        self._old = _Generation(None)
        self._parted: dict[str, list[str]] = {}
        """The last `missing` call's texts cut into parts, for `ids` of the same texts next."""
        self._joined: dict[tuple[str, str], tuple[bytes, int]] = {}
        """The last `missing` call's (salt, text)s whose pieces were all cached: their ids and
        pieces, for `ids` of the same texts next (a text's ids never change; the salt keeps a
        tenant from timing another's)."""

    @property
    def size(self) -> int:
        """Pieces held, both generations."""
        return self._young.size + self._old.size

    def ids(self, text: str, salt: str) -> bytes:
        """The ids of `text` as native uint32 bytes (`array("I").frombytes`)."""
        found = self._ids(text, salt, False)
        assert found is not None
        return found

    def ids_or_none(self, text: str, salt: str) -> bytes | None:
        """`ids`, or None when `text` is mostly new (`MOSTLY_NEW_PARTS`): encoded whole, its
        words cost the BPE once (~0.5 us a token) where piece by piece they cost the BPE
        plus a Python step, a slice and two dict entries each (~1.4 us a token, py-spy)."""
        return self._ids(text, salt, True)

    def _ids(self, text: str, salt: str, whole_when_new: bool) -> bytes | None:
        joined = self._joined.pop((salt, text), None)
        if joined is not None:
            self.stats.pieces += joined[1]
            return joined[0]
        parts = self._parted.pop(text, None)
        later = self._young.of(salt)[0]
        if parts is None:
            found = self._whole(self._young.tables.get(salt), salt, text)
            if found is not None:
                self.stats.pieces += found[1]
                return found[0]
            parts = parts_of(text, self.loose)
        self.stats.pieces += len(parts)
        head = self._find(salt, parts[0], False)
        whole = _all_young(later, head, parts)
        if whole is not None:
            return whole
        rest = parts[1:]
        got = list(map(later.get, rest))
        first = self._fill(salt, parts[0], head, rest, got, whole_when_new)
        if first is None:
            return None
        return first + b"".join(got)  # type: ignore[arg-type]

    def _whole(self, table: Any, salt: str, text: str) -> tuple[bytes, int] | None:
        """(`text`'s ids, its pieces) by `table` (a `WordTable`, or None: not compiled) when
        every space of it is a cut and every piece is cached (its later ones in `table`; its
        first one there too, else read here); else None, and the caller cuts it (`parts_of`).
        A text of bench point 2's prompts (~12k words a request) was a `str` made, hashed and
        looked up a word, ~0.1 us each."""
        tail = table.tail(text) if table is not None else None
        if tail is None:
            return None
        if not tail[0]:  # its first piece's ids too
            return tail[1], tail[2]
        if self._would_turn_over(salt, text[: tail[0]]):
            return None  # the later pieces just read would be the old generation's: cut
        head = self._find(salt, text[: tail[0]], False)
        return (head + tail[1], tail[2]) if head is not None else None

    def _would_turn_over(self, salt: str, first: str) -> bool:
        """Whether finding the first piece `first` may promote it from the old generation and
        turn the young one over. `_whole` then leaves the text to the cuts, which read the
        later pieces from the young generation after the first one's promotion, promoting
        them too, as a cache without a table does (the two caches hold the same pieces)."""
        young = self._young
        if young.size + 1 < self.max_pieces // 2:
            return False
        later = first[:1] == " "
        maps = young.salts.get(salt)
        return maps is None or (first[1:] if later else first) not in maps[0 if later else 1]

    def missing(self, texts: Sequence[str], salt: str) -> list[str]:
        """The pieces of `texts` the cache lacks, each once, as texts to encode."""
        return self.missing_or_whole(texts, salt, False)[0]

    def missing_or_whole(
        self, texts: Sequence[str], salt: str, whole_when_new: bool = True
    ) -> tuple[list[str], list[str]]:
        """(`missing`'s pieces, the texts mostly new: to encode whole, not piece by piece)."""
        out: dict[str, None] = {}
        whole_texts: list[str] = []
        self._parted = parted = {}
        self._joined = joined = {}
        for text in texts:
            # the young generation read again each time: a piece promoted from the old one
            # (`_find`) can turn it over
            found = self._whole(self._young.tables.get(salt), salt, text)
            if found is not None:
                joined[salt, text] = found
                continue
            parts = parts_of(text, self.loose)
            head = self._find(salt, parts[0], False)
            later = self._young.of(salt)[0]
            whole = _all_young(later, head, parts)
            if whole is not None:  # `ids` of it next looks up nothing
                joined[salt, text] = (whole, len(parts))
                continue
            if head is None:
                out[parts[0]] = None
            parted[text] = parts
            rest = parts[1:]
            got = list(map(later.get, rest))  # the young generation in C; the old one for gaps
            if head is None and None not in got:  # its first piece alone
                continue
            gaps = [part for part, found in zip(rest, got, strict=True) if found is None]
            new = [" " + part for part in gaps if self._find(salt, part, True) is None]
            if whole_when_new and len(parts) >= MOSTLY_NEW_PARTS and 2 * len(new) > len(parts):
                whole_texts.append(text)
                if head is None:
                    del out[parts[0]]
                continue
            out.update(dict.fromkeys(new))
        return list(out), whole_texts

    def add(self, salt: str, texts: Sequence[str], encoded: Sequence[Sequence[int]]) -> None:
        """Keep each piece's ids (`missing`'s pieces, encoded by the caller): a text that
        starts with a space is a later piece, the others first pieces."""
        for piece, ids in zip(texts, encoded, strict=True):
            later = piece[:1] == " "
            self._keep(salt, piece[1:] if later else piece, later, array.array("I", ids).tobytes())

    def _fill(
        self,
        salt: str,
        head: str,
        first: bytes | None,
        rest: list[str],
        got: list[bytes | None],
        whole_when_new: bool = False,
    ) -> bytes | None:
        """`got`'s gaps and, where `first` is None, the first piece `head`, from the old
        generation or the BPE (one call); None when `whole_when_new` and most are new."""
        parts = len(rest) + 1
        if whole_when_new and parts >= MOSTLY_NEW_PARTS and self._mostly_new(salt, rest, got):
            return None
        todo = [] if first is not None else [head]
        for i, found in enumerate(got):
            if found is None:
                got[i] = known = self._find(salt, rest[i], True)
                if known is None:
                    todo.append(" " + rest[i])
        if todo:
            unique = list(dict.fromkeys(todo))
            encoded = self.encode_many(unique)
            self.stats.misses += len(unique)
            self.stats.tokens_encoded += sum(map(len, encoded))
            new = {p: array.array("I", e).tobytes() for p, e in zip(unique, encoded, strict=True)}
            for piece, ids in new.items():  # converted once (`add` would again)
                later = piece[:1] == " "
                self._keep(salt, piece[1:] if later else piece, later, ids)
            if first is None:
                first = new[head]
            for i, found in enumerate(got):
                if found is None:
                    got[i] = new[" " + rest[i]]
        assert first is not None
        return first

    def _mostly_new(self, salt: str, rest: list[str], got: list[bytes | None]) -> bool:
        """Whether more than half of the later pieces are in neither generation: the young
        one's gaps counted in C, the old one asked about the first `MOSTLY_NEW_PARTS` of
        them only (a Python step each: the loop this spares)."""
        gaps = got.count(None)
        if 2 * gaps <= len(got):
            return False
        maps = self._old.salts.get(salt)
        if maps is None:
            return True
        old = maps[0]
        probe = itertools.islice(
            (p for p, g in zip(rest, got, strict=True) if g is None), MOSTLY_NEW_PARTS
        )
        known = sum(p in old for p in probe)
        return 2 * known < min(gaps, MOSTLY_NEW_PARTS)

    def _find(self, salt: str, key: str, later: bool) -> bytes | None:
        """A piece's ids from the young generation, else from the old one (promoted)."""
        if not later and key[:1] == " ":  # a first piece " x" is the later piece "x"
            later, key = True, key[1:]
        kind = 0 if later else 1
        found = self._young.of(salt)[kind].get(key)
        if found is not None:
            return found
        maps = self._old.salts.get(salt)
        found = maps[kind].get(key) if maps is not None else None
        if found is not None:
            self._keep(salt, key, later, found)
        return found

    def _keep(self, salt: str, key: str, later: bool, ids: bytes) -> None:
        if not later and key[:1] == " ":
            later, key = True, key[1:]
        young = self._young
        table = young.of(salt)[0 if later else 1]
        if key not in table:
            young.size += 1
        table[key] = ids
        if young.table is not None:
            young.tables[salt].put(key, ids, not later)
        if young.size >= self.max_pieces // 2:  # the old one's tables go: never read
            young.tables = {}
            young.table = None
            self._old, self._young = young, _Generation(self.table)


__all__ = [
    "DEFAULT_WORD_CACHE_PIECES",
    "WordIds",
    "WordStats",
    "cuts",
    "parts_of",
    "rule_holds",
    "split",
]
