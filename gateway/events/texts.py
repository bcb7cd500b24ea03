"""Long texts' token ids kept with the places they were cut, so that a text beginning like one
encoded before encodes only from where the two part.

    text ──(salt, its first OPENING_CHARS)──▶ up to TEXTS_PER_OPENING texts encoded before
         ──the longest common prefix (memcmp)──▶ L characters shared
         ──the last cut c of that text with c + margin <= L──▶ ids(text[:c]) = its ids[:at(c)]
    ids(text) = ids[:at(c)] + ids(text[c:])       (only text[c:] goes to the segment path)

A cut is where the text was split into pieces when it was encoded (`PromptTokens._cut`): right
before an added token (the tokenizer splits its input at those before anything else) or before
a space between two non-spaces (a byte-level pre-tokenizer starts a piece there whatever follows;
on only when the model's pre-tokenizer passes the probes, `prompts.chunks_concatenate`, and
sampled against whole encodings). Whether c is such a cut depends on the characters from the
text's start to c + margin at most (the space and the character after it; an added token's
length), so a cut of the old text that lies `margin` characters inside the shared prefix is a
cut of the new text too, and the ids before it are the same.

Entries are keyed under the request's cache salt, like every tokenization cache: a tenant
neither reads nor times another's texts. Bounded in bytes (the text, its ids at 4 bytes each,
its cuts), LRU by opening; a text that extends an entry (a conversation's next turn sent as one
message) replaces it.
"""

from __future__ import annotations

import array
import bisect
import sys
from collections import OrderedDict
from dataclasses import dataclass

from cachemap.native import NATIVE

DEFAULT_TEXT_PREFIX_BYTES = 32 << 20
"""Bytes of texts, ids and cuts kept (~6 MB a 100k-token prompt: ~5 such, or ~50 of 12k)."""
OPENING_CHARS = 256
"""Characters of a text's start that find its entries."""
TEXTS_PER_OPENING = 16
"""Texts kept per opening (and salt): conversations that open alike (one system prompt) each
find their own; each is compared from the start until it parts (a memcmp of the shared part)."""
_LINEAR = 8
"""Below this many characters the common prefix is finished a character at a time (a Python
step each: at 64, ~32 steps a compare where 3 more halvings cost 3; 24.0 -> 22.1 us a compare
of two 60 kB texts that part at random)."""
_FIRST_STEP = 1_024
"""The first step of `common_prefix`'s growing compares."""


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`: a memcmp when one extends the
    other; else compared in growing steps from the start (texts that part early cost what
    they share, not their length), then a binary search of the step that differs. Each probe
    copies only the range of `b` still in doubt: ~2 passes over the shared part in all."""
    n = min(len(a), len(b))
    if b.startswith(a) if len(a) <= len(b) else a.startswith(b):  # no slice: no copy
        return n
    low, step = 0, _FIRST_STEP  # a[:low] == b[:low]
    while True:
        high = min(low + step, n)
        if not a.startswith(b[low:high], low):
            break  # the first difference is in [low, high)
        low, step = high, 2 * step
    while high - low > _LINEAR:
        mid = (low + high) // 2
        if a.startswith(b[low:mid], low):
            low = mid
        else:
            high = mid
    while low < high and a[low] == b[low]:
        low += 1
    return low


_COMMON_PREFIX = NATIVE.common_prefix if NATIVE is not None else common_prefix
"""`common_prefix`, compiled where built (`cachemap._native.common_prefix`: 8 bytes a step,
no slice made; the pure form's growing steps were ~14 slices and `startswith`s a compare)."""


@dataclass(frozen=True, slots=True)
class TextIds:
    """A text's ids and its cuts: `cuts[i]` a character offset where a piece began (0 first),
    `at[i]` the offset in `ids` of that piece's first token."""

    text: str
    ids: array.array[int]
    cuts: array.array[int]
    at: array.array[int]

    @property
    def size(self) -> int:
        # getsizeof: a text with a non-Latin-1 character takes 2 or 4 bytes a character
        return sys.getsizeof(self.text) + 4 * len(self.ids) + 16 * len(self.cuts) + 200


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a text takes from an entry: `ids[:tokens]`, the ids of its first `start`
    characters, and the cuts up to there (`cuts`, `at`, both ending with `start`; read
    only: they may be the entry's own)."""

    ids: array.array[int]
    tokens: int
    start: int
    cuts: array.array[int]
    at: array.array[int]


class TextPrefixes:
    """The salted, bounded cache of long texts' ids by their cuts (module docstring)."""

    def __init__(self, margin: int, max_bytes: int = DEFAULT_TEXT_PREFIX_BYTES) -> None:
        if margin < 2:
            raise ValueError(f"margin must be at least 2, got {margin}")
        self.margin = margin
        """Characters past a cut that must be shared for it to be one in both texts."""
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.reused_chars = 0
        self._entries: OrderedDict[tuple[str, str], list[TextIds]] = OrderedDict()

    def find(self, text: str, salt: str) -> Reuse | None:
        """The most of `text` an entry under `salt` gives, or None (nothing past its start)."""
        entries = self._entries.get((salt, text[:OPENING_CHARS]))
        if not entries:
            return None
        best: TextIds | None = None
        shared = 0
        for entry in entries:
            length = _COMMON_PREFIX(entry.text, text)
            if length > shared:
                best, shared = entry, length
        if best is None:
            return None
        self._entries.move_to_end((salt, text[:OPENING_CHARS]))
        if shared == len(best.text) == len(text):
            self.hits += 1
            self.reused_chars += shared
            return Reuse(best.ids, len(best.ids), shared, best.cuts, best.at)
        i = bisect.bisect_right(best.cuts, shared - self.margin) - 1
        if i <= 0:
            return None
        self.hits += 1
        start = best.cuts[i]
        self.reused_chars += start
        return Reuse(best.ids, best.at[i], start, best.cuts[: i + 1], best.at[: i + 1])

    def keep(self, salt: str, entry: TextIds) -> None:
        """Keep `entry` (the newest of its opening); texts it extends or equals go."""
        size = entry.size
        if size > self.max_bytes:
            return
        slot = (salt, entry.text[:OPENING_CHARS])
        entries = self._entries.pop(slot, [])
        kept = [entry]
        for old in entries:
            if entry.text.startswith(old.text) or len(kept) >= TEXTS_PER_OPENING:
                self.bytes -= old.size
            else:
                kept.append(old)
        self._entries[slot] = kept
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= sum(e.size for e in dropped)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


__all__ = ["DEFAULT_TEXT_PREFIX_BYTES", "Reuse", "TextIds", "TextPrefixes", "common_prefix"]
