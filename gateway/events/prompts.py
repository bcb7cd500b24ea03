"""Prompt token ids as the engine will see them, computed once per new piece of a
conversation.

    chat ──message keys──▶ longest cached prefix k ──▶ ids(S(k)) (prefix cache)
         ──template, messages k-1.. only──▶ tail text ──segments──▶ ids (segment cache)
         ids(S(n)) = ids(S(k)) + ids(tail) kept for the next turn; + ids(G) when asked
    completion / a chat that cannot go incrementally ──whole text──▶ segments ──▶ ids

Two caches, both LRU and bounded in tokens (4 bytes each), both keyed under the request's
cache salt, so a tenant can neither read another's entries nor time them (a hit is faster
than a miss: an unsalted cache would tell tenant B that tenant A sent this system prompt):

- segments (`DEFAULT_SEGMENT_CACHE_TOKENS`): the rendering cut right before every added
  token. A Hugging Face tokenizer splits its input at added tokens before anything else, so
  encoding the pieces one by one gives exactly the ids of encoding the whole; in a chat every
  message starts with one (`<|im_start|>`).
  A segment longer than `CHUNK_CHARS` is cut again right before a space between two
  non-spaces (`word_cuts`), about every `CHUNK_CHARS`: a byte-level BPE's
  pre-tokenizer starts a new piece there whatever follows, so the pieces' ids concatenate to
  the segment's, and a long message that begins like an earlier one (one user message of
  ~12k tokens at bench point 2, a pasted document) encodes only from the piece where the two
  part. Enabled when probes of every kind of text encode the same whole and cut
  (`chunks_concatenate`), and checked like the incremental rendering: the first cut text and
  every `VERIFY_EVERY`-th is also encoded whole; a difference turns cutting off for good.
  A segment the cache lacks is encoded word by word under the same rule (`words`, each piece
  from a salted word cache; `gateway.events.words`): a new turn costs a dict lookup a word, not
  the tokenizer's ~1.3 µs a token. The same probes and checks govern it.
- prefixes (`DEFAULT_PREFIX_CACHE_TOKENS`): a conversation's ids up to the end of its last
  message without the generation prompt, found by a chain of keys over its messages'
  JSON (`key(i) = H(key(i-1) || message i)`, `key(-1) = H(salt, tools)`), so a continuation
  renders and tokenizes only the messages it adds (`cachemap.incremental` says when a
  template allows it). The entry a continuation came from is moved to the old end: one
  conversation keeps one live entry, and a fan-out sibling arriving just after still finds it.
  The message keys themselves are kept per conversation (`DEFAULT_MESSAGE_KEYS_BYTES`, LRU),
  found by key(0), which holds the salt like every other entry (up to
  `CHATS_PER_FIRST_MESSAGE` conversations that open alike under one key(0)), with the JSON of
  the whole message list they were computed from: a request whose list's JSON starts with one's
  (up to its closing bracket, then a comma) holds the same first messages, so their keys are
  reused and only the new messages are serialized and hashed (one `orjson.dumps` of the list
  and a memcmp instead of a dump and a hash a message).

Residual channel, stated: the bounds are shared, so one tenant's volume evicts another's
entries sooner (as the engines' own KV caches do); no entry is ever shared.

The incremental rendering is compared with the whole one for the first request and every
`VERIFY_EVERY`-th after (a whole render of the sample): a difference turns it off for good,
counted and logged as a WARNING (the ids returned are then the whole rendering's).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mmh3
import orjson

from cachemap.chat_template import ChatTemplateError
from cachemap.incremental import IncrementalTemplate
from cachemap.tokenizer import ModelTokenizer, chat_flag
from gateway.events.texts import DEFAULT_TEXT_PREFIX_BYTES, Reuse, TextIds, TextPrefixes
from gateway.events.words import DEFAULT_WORD_CACHE_PIECES, WordIds, rule_holds

log = logging.getLogger(__name__)

TOKENIZER_THREADS = ("TOKENIZERS_PARALLELISM", "false")
"""Set in the gateway's environment unless the operator set it: the `tokenizers` library then
encodes on the calling thread instead of handing each call to its rayon pool. A call's hand-off
and the pool's threads spinning for work after it cost more CPU than the BPE itself on this
machine (`tools.precise_cost keying`, one run alternating: a continuation's ~400 new tokens
1,098-1,114 µs of process CPU through the pool, 399-494 µs without). Big texts still leave the
event loop (`OFF_LOOP_CHARS`), in a worker thread of our own."""
OFF_LOOP_CHARS = 16_384
"""Text to encode above which it is encoded in a thread (~4k tokens, ~5 ms of the loop); below
it the thread hop (~0.1 ms) costs more than it saves."""
DEFAULT_SEGMENT_CACHE_TOKENS = 4_000_000
"""Token ids kept of tokenized segments (4 bytes each: 16 MB): the system prompts, tools and
turns of ~40 live 100k-token conversations, or thousands of ordinary chats."""
DEFAULT_PREFIX_CACHE_TOKENS = 8_000_000
"""Token ids kept of conversation prefixes (32 MB): one entry per live conversation, so ~80
conversations at 100k tokens or ~2,000 at 4k."""
CHATS_PER_FIRST_MESSAGE = 8
"""Message lists kept per first message (and salt, and tools): conversations that open alike
(one system prompt, fan-out siblings) each find their own last list; one slot per first
message made them evict each other, so that every request of two interleaved ones was keyed
from scratch."""
DEFAULT_MESSAGE_KEYS_BYTES = 32 << 20
"""JSON of conversations' message lists kept with their message keys (32 MB): ~270 chats at
turn 40 of bench-cpu's conversations (120 kB each), ~80 agent sessions of 100k tokens."""
CHUNK_CHARS = 2_048
"""A segment longer than this is cut at a word boundary about every this many characters
(~450 tokens): a prefix shared with an earlier text is reused up to the cut before they part,
so ~half a piece of it is encoded again; each piece costs a cache entry and a lookup (~1 µs),
~0.2% of encoding it."""
_CHUNK_PROBES = (
    "Hello world, it's 2024: 3.14159 rocks!  Two  spaces,\tTabs\n\nnew lines; don't stop.",
    "  leading spaces and trailing ones   ",
    "naïve café — “quotes” 日本語 テキスト 中文 emoji 🙂🙂 x = a+b*c; f(x) != g(y) ' quote",
    "a " * 40 + "\n b \r\n c" + " ..." * 20 + " 12345 67890 1 2 3",
    "class A:\n    def f(self, x):\n        return  x + 1  # one\n\n\t\tx = [1, 2]\n",
)
"""Texts of every kind (words, digits, punctuation, runs of spaces, newlines, non-ASCII)
whose ids, encoded whole and encoded cut at every word boundary, must agree for cutting to
be on: a tokenizer whose pre-tokenizer adds a prefix space to each piece (SentencePiece's
Metaspace) or splits otherwise fails them."""
CHECK_CHARS = 4_096
"""A sampled check of cut texts encodes at most this much text whole (~1k tokens, ~1.3 ms)."""
VERIFY_EVERY = 64
"""Every Nth incremental rendering (and the first) is also rendered whole and compared: ~1.5%
more rendering, and a template the probes did not catch is turned off within 64 requests."""
_PROMPTS_DOMAIN = b"kvgate/prompts/v1"
_COMMA = ord(",")


FEW_SPECIAL_FIRSTS = 64
"""`special_starts` tests at most this many places where an added token could start before it
falls back to a find per token (a text of markup, `<` after `<`)."""


def firsts_of(specials: Sequence[str]) -> str:
    """The first characters of the added tokens, for `special_starts`; "" when one of them
    overlaps itself (a proper prefix that is also its suffix, "aba"): two of its occurrences
    may overlap, and a find per token skips the second as the cuts always have."""
    for token in specials:
        if any(token[:n] == token[-n:] for n in range(1, len(token))):
            return ""
    return "".join(dict.fromkeys(t[0] for t in specials if t))


def special_starts(text: str, specials: tuple[str, ...], firsts: str, start: int = 0) -> set[int]:
    """`start` and where each of `specials` (tokens that never overlap themselves,
    `firsts_of`) occurs in `text[start:]`: a find of each first character and one
    `startswith` of them all where it is (~4 against ~11 us a continuation's tail with
    ChatML's 8 added tokens, 8 finds over the whole text). Without `firsts`, or past
    `FEW_SPECIAL_FIRSTS` such places, every token's occurrences, one find after another."""
    starts = {start}
    for first in firsts:
        i = text.find(first, start)
        tested = 0
        while i >= 0 and tested < FEW_SPECIAL_FIRSTS:
            if text.startswith(specials, i):
                starts.add(i)
            tested += 1
            i = text.find(first, i + 1)
        if i >= 0:
            break  # markup: a find per token instead
    else:
        if firsts:
            return starts
    for token in specials:
        i = text.find(token, start)
        while i >= 0:
            starts.add(i)
            i = text.find(token, i + len(token))
    return starts


@dataclass
class TokenizeStats:
    requests: int = 0
    segments: int = 0
    segment_hits: int = 0
    tokens: int = 0
    tokens_encoded: int = 0
    """Tokens of segments that missed the cache (what was really encoded)."""
    prefix_hits: int = 0
    """Chats rendered from a cached prefix (only their new messages)."""
    prefix_tokens: int = 0
    """Tokens taken from the prefix cache."""
    incremental_checks: int = 0
    incremental_mismatches: int = 0
    chunk_checks: int = 0
    """Texts cut at word boundaries that were also encoded whole and compared."""
    chunk_mismatches: int = 0
    text_prefix_hits: int = 0
    """Long texts encoded from where they part from one encoded before (`texts`)."""
    text_prefix_tokens: int = 0
    """Tokens taken from the text-prefix cache."""
    message_keys_reused: int = 0
    """Messages whose keys came from their conversation's last list (not serialized again)."""
    seconds: float = 0.0
    """Time spent rendering, tokenizing and hashing (the precise mode's CPU per request)."""


@dataclass(frozen=True, slots=True)
class _Cut:
    """A text to encode: `pieces` of `text[start:]` (cut before added tokens and at word
    boundaries), and `reuse`: the ids of `text[:start]` from the text-prefix cache (None:
    `start` is 0)."""

    pieces: list[str]
    cut: bool
    """Whether any piece was cut at a word boundary (or the text spliced onto a prefix)."""
    start: int = 0
    reuse: Reuse | None = None


@dataclass
class _Plan:
    """A prompt's ids = `head` + ids(`text`) [kept at `key`] + ids(`suffix`)."""

    salt: str
    head: array.array[int]
    text: str
    suffix: str = ""
    key: bytes | None = None
    header: tuple[bytes, str] | None = None
    """(key(0), S(1)): a conversation's first message (and tools) kept for the next one."""
    verify: Mapping[str, Any] | None = None
    """The body to render whole and compare (a sampled incremental rendering)."""


class PromptTokens:
    """Render and tokenize requests through the two salted caches (module docstring)."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        max_cached_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS,
        max_prefix_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        *,
        max_message_keys_bytes: int = DEFAULT_MESSAGE_KEYS_BYTES,
        incremental: bool = True,
        chunking: bool = True,
        words: bool = True,
        max_word_pieces: int = DEFAULT_WORD_CACHE_PIECES,
        text_prefixes: bool = True,
        max_text_prefix_bytes: int = DEFAULT_TEXT_PREFIX_BYTES,
        chunk_chars: int | None = None,
        text_prefix_min_chars: int | None = None,
    ) -> None:
        os.environ.setdefault(*TOKENIZER_THREADS)
        self.tokenizer = tokenizer
        self.max_cached_tokens = max_cached_tokens
        self.max_prefix_tokens = max_prefix_tokens
        self.stats = TokenizeStats()
        added = tokenizer.added_tokens()
        self._specials = tuple(t for t in added if t)
        self._special_firsts = firsts_of(self._specials)
        self.chunk_chars = CHUNK_CHARS if chunk_chars is None else chunk_chars
        """Long segments are cut at a word boundary about every this many characters."""
        self.template = IncrementalTemplate(tokenizer.template, added)
        self.incremental = incremental and self.template.enabled
        # a cut inside an added token would split it, and one that strips the spaces beside it
        # eats the space a piece starts with: no cutting with either kind
        cuttable = tokenizer.added_tokens_are_plain()
        self.chunking = chunking and cuttable and chunks_concatenate(tokenizer, self.chunk_chars)
        self.words = words and self.chunking
        """Segments the cache lacks are encoded word by word (`gateway.events.words`)."""
        loose = self.words and rule_holds(tokenizer.encode_many, _CHUNK_PROBES, loose=True)
        self.word_ids = WordIds(tokenizer.encode_pieces, max_word_pieces, loose=loose)
        self._cut_count = 0
        """Texts encoded through a cut (chunks or words): the sampled checks count these."""
        self._last_cut: tuple[str | None, str, bool, _Cut] = (None, "", False, _Cut([], False))
        """(text, salt, chunking, its cut): the last text `_cut` answered."""
        self.text_prefixes = text_prefixes
        """Long texts go through the text-prefix cache (`gateway.events.texts`) while
        `chunking` is on (its cuts are the chunks' and added tokens')."""
        self.text_prefix_min_chars = (
            2 * self.chunk_chars if text_prefix_min_chars is None else text_prefix_min_chars
        )
        """Texts shorter than this skip it (a chat turn's tail: its pieces are few)."""
        margin = max([2, *(len(t) + 1 for t in self._specials)])
        self.texts = TextPrefixes(margin, max_text_prefix_bytes)
        self._cache: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        """(salt, segment) -> its ids as native uint32 bytes (what the word cache answers:
        kept as given, no array made and filled a piece)."""
        self._cached_tokens = 0
        self._prefixes: OrderedDict[bytes, array.array[int]] = OrderedDict()
        self._prefix_tokens = 0
        self._incremental_count = 0
        self._chats: OrderedDict[bytes, list[tuple[bytes, list[bytes]]]] = OrderedDict()
        """key(0) -> the JSON of the last message lists keyed from it and their message keys,
        the latest first (at most `CHATS_PER_FIRST_MESSAGE`)."""
        self._chat_bytes = 0
        self.max_message_keys_bytes = max_message_keys_bytes

    async def ids_off_loop(
        self, body: Mapping[str, Any], chat: bool, cache_salt: str = ""
    ) -> Sequence[int]:
        """`ids`, with the segments the cache lacks encoded in a worker thread when they are
        over `OFF_LOOP_CHARS` (the tokenizer releases the GIL): a burst of long first turns
        must not hold the event loop (it did: connections to the engines timed out behind
        it)."""
        plan = self._plan(body, chat, cache_salt)
        if isinstance(plan, list):
            return plan
        pieces = self._cut(plan.text, cache_salt).pieces
        missing = [p for p in dict.fromkeys(pieces) if (cache_salt, p) not in self._cache]
        whole = missing
        if self.words and sum(len(p) for p in missing) > OFF_LOOP_CHARS:
            # their new words only, but a segment mostly of new words whole (one BPE call)
            # (not when the text is a sampled check's: that one must go through the cuts)
            whole_when_new = not self._cut_check_due()
            missing, whole = self.word_ids.missing_or_whole(missing, cache_salt, whole_when_new)
        elif self.words:
            missing, whole = [], []  # small: `encode` looks its words up on the loop
        else:
            missing = []
        if sum(len(p) for p in missing) + sum(len(p) for p in whole) > OFF_LOOP_CHARS:
            encoded, encoded_whole = await asyncio.to_thread(self._encode_off_loop, missing, whole)
            self.stats.tokens_encoded += sum(map(len, encoded)) + sum(map(len, encoded_whole))
            self.word_ids.add(cache_salt, missing, encoded)
            for piece, ids in zip(whole, encoded_whole, strict=True):
                self._keep(cache_salt, piece, array.array("I", ids).tobytes())
        return self._assemble(plan, body, chat)

    def _encode_off_loop(
        self, pieces: list[str], whole: list[str]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(new words' ids: one BPE call over them joined, `encode_pieces`; whole segments')."""
        return (
            self.tokenizer.encode_pieces(pieces) if pieces else [],
            self.tokenizer.encode_many(whole) if whole else [],
        )

    def ids(self, body: Mapping[str, Any], chat: bool, cache_salt: str = "") -> Sequence[int]:
        """The prompt's token ids (`ChatTemplateError` for a malformed request): an
        `array("I")` built from cached arrays without boxing an int per token."""
        plan = self._plan(body, chat, cache_salt)
        return plan if isinstance(plan, list) else self._assemble(plan, body, chat)

    def _plan(self, body: Mapping[str, Any], chat: bool, salt: str) -> _Plan | list[int]:
        if not chat or not self.incremental or chat_flag(body, "continue_final_message", False):
            prompt = self.tokenizer.prompt_of(body, chat)
            return prompt if isinstance(prompt, list) else _Plan(salt, array.array("I"), prompt)
        messages, tools = self.tokenizer.chat_parts(body)
        agp = chat_flag(body, "add_generation_prompt", True)
        suffix = self.template.generation_prompt if agp else ""
        keys = self._message_keys(salt, messages, tools)
        if keys is None:  # not JSON (a huge int): whole, uncached
            text = self.tokenizer.render_chat(messages, tools, add_generation_prompt=agp)
            return _Plan(salt, array.array("I"), text)
        whole_key = self._prefixes.get(keys[-1])
        if whole_key is not None:  # the same conversation again (a retry, a sibling)
            self._prefixes.move_to_end(keys[-1])
            self.stats.prefix_hits += 1
            self.stats.prefix_tokens += len(whole_key)
            return _Plan(salt, whole_key, "", suffix)
        n = len(messages)
        for k in range(n - 1, 0, -1):
            head = self._prefixes.get(keys[k - 1])
            if head is None:
                continue
            tail = self.template.tail(messages, k)
            if tail is None:
                break
            self._prefixes.move_to_end(keys[k - 1], last=False)  # see the module docstring
            self.stats.prefix_hits += 1
            self.stats.prefix_tokens += len(head)
            self._incremental_count += 1
            verify = self._incremental_count % VERIFY_EVERY == 1 or VERIFY_EVERY == 1
            return _Plan(salt, head, tail, suffix, keys[-1], None, body if verify else None)
        # rendered whole, as the engine renders it; S(n) kept when the rendering ends with G
        # at a segment boundary (then ids(S(n)) are exactly the ids before G's)
        text = self.tokenizer.render_chat(messages, tools, add_generation_prompt=agp)
        key: bytes | None = keys[-1]
        if suffix:
            if text.endswith(suffix) and suffix.startswith(self._specials):
                text = text[: -len(suffix)]
            else:
                text, suffix, key = text, "", None
        header = None
        if n > 1 and key is not None and keys[0] not in self._prefixes:
            try:
                first = self.template.whole(messages[:1], tools)
            except ChatTemplateError:  # a template that refuses a lone first message
                first = ""
            if first and text.startswith(first) and text[len(first) :].startswith(self._specials):
                header = (keys[0], first)
        return _Plan(salt, array.array("I"), text, suffix, key, header)

    def _assemble(self, plan: _Plan, body: Mapping[str, Any], chat: bool) -> array.array[int]:
        out = array.array("I", plan.head)
        out.extend(self.encode(plan.text, plan.salt))
        if plan.key is not None:
            self._keep_prefix(plan.key, out)
        if plan.header is not None:
            self._keep_prefix(plan.header[0], self.encode(plan.header[1], plan.salt))
        if plan.suffix:
            out.extend(self.encode(plan.suffix, plan.salt))
        if plan.verify is not None:
            out = self._verify(plan, out, body, chat)
        self.stats.tokens += len(out)
        return out

    def _verify(
        self, plan: _Plan, ids: array.array[int], body: Mapping[str, Any], chat: bool
    ) -> array.array[int]:
        self.stats.incremental_checks += 1
        prompt = self.tokenizer.prompt_of(body, chat)
        assert isinstance(prompt, str)
        whole = self._encode_pieces(self._cut_anew(prompt)[0], plan.salt)  # not a cut check
        if whole == ids:
            return ids
        self.stats.incremental_mismatches += 1
        self.incremental = False
        self._prefixes.clear()
        self._prefix_tokens = 0
        log.warning(
            "precise mode: rendering this chat template message by message differs from "
            "rendering it whole (%d ids against %d); every chat is now rendered whole",
            len(ids),
            len(whole),
        )
        return whole

    def encode(self, text: str, salt: str = "") -> array.array[int]:
        """The ids of `text`: a long one from where it parts from a text encoded before
        (`gateway.events.texts`), the rest segment by segment through the salted segment
        cache (a segment it lacks word by word when `words`)."""
        cut = self._cut(text, salt)
        cutting = cut.cut or (self.words and " " in text)
        check = cutting and self._cut_check_due()
        if cutting:
            self._cut_count += 1
        reuse = cut.reuse
        kept = self._keeps_text(text)
        at: list[int] | None = [] if kept or reuse is not None else None
        if reuse is None:
            out = self._encode_pieces(cut.pieces, salt, None, at, not check)
        else:
            out = self._encode_pieces(cut.pieces, salt, reuse.ids[: reuse.tokens], at, not check)
            self.stats.text_prefix_hits += 1
            self.stats.text_prefix_tokens += reuse.tokens
        if kept and at is not None:
            self._keep_text(text, salt, cut, out, at)
        return self._check_chunks(text, out, salt, cut, at or []) if check else out

    def _keeps_text(self, text: str) -> bool:
        return self.text_prefixes and self.chunking and len(text) >= self.text_prefix_min_chars

    def _keep_text(
        self, text: str, salt: str, cut: _Cut, ids: array.array[int], at: list[int]
    ) -> None:
        """Keep `text`'s ids with its cuts: where each piece began (`at`: its first token)."""
        if len(at) != len(cut.pieces):  # an empty piece (never cut so): not kept
            return
        starts = array.array("q", itertools.accumulate(map(len, cut.pieces), initial=cut.start))
        del starts[-1]
        tokens = array.array("q", at)
        reuse = cut.reuse
        if reuse is not None:  # the cuts before `start`, then the new pieces' (start again)
            starts = reuse.cuts[:-1] + starts
            tokens = reuse.at[:-1] + tokens
        self.texts.keep(salt, TextIds(text, ids[:], starts, tokens))  # ids: the caller's

    def _encode_pieces(
        self,
        pieces: list[str],
        salt: str,
        head: array.array[int] | None = None,
        at: list[int] | None = None,
        whole_when_new: bool = True,
    ) -> array.array[int]:
        """The ids of `pieces` appended to `head` (a new array when None); `at`: each
        piece's first token's offset appended (a piece is empty only as the text "").
        `whole_when_new`: a piece mostly of words the word cache lacks is encoded whole.

        The pieces' ids are joined once at the end: an `extend` a piece grew the array by
        1/16 at a time, a `realloc` and a copy of all of it each (~9% of keying bench point
        2's prompts, py-spy)."""
        out: array.array[int] = head if head is not None else array.array("I")
        stats = self.stats
        cache = self._cache
        word_ids = self.word_ids
        lookup = (word_ids.ids_or_none if whole_when_new else word_ids.ids) if self.words else None
        chunks: list[bytes] = []
        length = len(out)
        for piece in pieces:
            if not piece:
                continue
            if at is not None:
                at.append(length)
            stats.segments += 1
            slot = (salt, piece)
            cached = cache.get(slot)
            if cached is not None:
                cache.move_to_end(slot)
                stats.segment_hits += 1
                chunks.append(cached)
                length += len(cached) >> 2
                continue
            before = word_ids.stats.tokens_encoded
            found = lookup(piece, salt) if lookup is not None else None
            if found is not None:
                stats.tokens_encoded += word_ids.stats.tokens_encoded - before
            else:
                found = array.array("I", self.tokenizer.encode(piece)).tobytes()
                stats.tokens_encoded += len(found) >> 2
            chunks.append(found)
            length += len(found) >> 2
            self._keep(salt, piece, found)
        if chunks:
            out.frombytes(b"".join(chunks))
        return out

    def _cut_check_due(self) -> bool:
        """Whether the text now encoded through a cut (chunks or words) is a sampled check:
        the first such text and every `VERIFY_EVERY`-th after it."""
        return self.chunking and self._cut_count % VERIFY_EVERY == 0

    def _check_chunks(
        self, text: str, ids: array.array[int], salt: str, cut: _Cut, at: list[int]
    ) -> array.array[int]:
        """A sampled text's ids through the cuts against the BPE of it whole; a longer text
        than `CHECK_CHARS` is checked on its first `CHECK_CHARS` (the rule is local to each
        space, and a whole 50 kB prompt was ~13 ms of BPE on the event loop), and one spliced
        onto a cached prefix also on up to `CHECK_CHARS` around the splice."""
        self.stats.chunk_checks += 1
        sample, ours = text, ids
        if len(text) > CHECK_CHARS:
            sample = text[:CHECK_CHARS]
            ours = self._encode_pieces(self._cut_anew(sample)[0], salt)
        whole = array.array("I", self.tokenizer.encode(sample))
        if whole == ours and cut.reuse is not None:
            sample, ours = self._splice_sample(text, ids, cut, at)
            whole = array.array("I", self.tokenizer.encode(sample))
        if whole == ours:
            return ids
        if sample is not text:
            whole = array.array("I", self.tokenizer.encode(text))
        self.stats.chunk_mismatches += 1
        self.chunking = self.words = False
        self._cache.clear()  # pieces of cut texts: some may hold the wrong ids
        self._cached_tokens = 0
        self.texts.clear()
        self._prefixes.clear()
        self._prefix_tokens = 0
        log.warning(
            "precise mode: this tokenizer's ids of a text cut at word boundaries differ from "
            "its ids of the whole (%d ids against %d); texts are now encoded whole",
            len(ids),
            len(whole),
        )
        return whole

    def _splice_sample(
        self, text: str, ids: array.array[int], cut: _Cut, at: list[int]
    ) -> tuple[str, array.array[int]]:
        """About `CHECK_CHARS` of `text` around where it was spliced onto a cached prefix,
        from a cut to a cut, and our ids of it (`at`: the new pieces' first tokens)."""
        reuse = cut.reuse
        assert reuse is not None
        half = CHECK_CHARS // 2
        i = max(bisect.bisect_right(reuse.cuts, cut.start - half) - 1, 0)
        end, end_at = len(text), len(ids)
        offset = cut.start
        for piece, first in zip(cut.pieces, at, strict=False):
            if offset - cut.start >= half:
                end, end_at = offset, first
                break
            offset += len(piece)
        return text[reuse.cuts[i] : end], ids[reuse.at[i] : end_at]

    def segments(self, text: str) -> list[str]:
        """`text` cut right before every added token (str.find per token: a regex lookahead at
        every position was 1 ms per 80 kB), and a long piece again at word boundaries about
        every `chunk_chars` when `chunking` (the module docstring)."""
        return list(self._cut_anew(text)[0])

    def _cut(self, text: str, salt: str) -> _Cut:
        """`text` as pieces to encode: a long one from where it parts from a text encoded
        before under `salt` (the text-prefix cache), the rest cut as `segments` cuts it.
        The last text's answer is kept: `ids_off_loop` cuts a text to find its missing pieces
        and `encode` cuts the same text again (~12 µs of a continuation's tail, py-spy)."""
        last = self._last_cut
        if last[0] is text and last[1] == salt and last[2] == self.chunking:
            return last[3]
        reuse = self.texts.find(text, salt) if self._keeps_text(text) else None
        if reuse is None:
            pieces, cut = self._cut_anew(text)
            out = _Cut(pieces, cut)
        else:
            pieces, _ = self._cut_anew(text, reuse.start)
            out = _Cut(pieces, True, reuse.start, reuse)
        self._last_cut = (text, salt, self.chunking, out)
        return out

    def _cut_anew(self, text: str, start: int = 0) -> tuple[list[str], bool]:
        """`text[start:]` cut before every added token and, when `chunking`, long segments
        at word boundaries, as the whole text is cut when `start` is one of its cuts: the
        chunks of a segment are counted from its start or from a chunk's cut alike."""
        chunk = self.chunk_chars
        cuts = sorted(special_starts(text, self._specials, self._special_firsts, start))
        ends = [*cuts[1:], len(text)]
        cut = False
        if self.chunking and len(text) - start > chunk:
            for a, b in zip(list(cuts), list(ends), strict=True):
                if b - a > chunk:
                    words = word_cuts(text, a, b, chunk)
                    cuts.extend(words)
                    cut = cut or bool(words)
            if cut:
                cuts.sort()
                ends = [*cuts[1:], len(text)]
        return [text[a:b] for a, b in zip(cuts, ends, strict=True)], cut

    def _message_keys(
        self, salt: str, messages: Sequence[Any], tools: Sequence[Any] | None
    ) -> list[bytes] | None:
        """key(i) = H(key(i-1) || JSON of message i) for every message (module docstring),
        the keys of the first messages taken from this conversation's last list when its JSON
        begins this one's; None when the messages are not JSON."""
        if not messages:
            return []
        digest = mmh3.mmh3_x64_128_digest
        try:
            key = digest(_PROMPTS_DOMAIN + salt.encode() + b"\x00" + orjson.dumps(tools))
            first = digest(key + orjson.dumps(messages[0]))
            if len(messages) == 1:
                # nothing to keep, nor to serialize again whole: a later list computes key(0)
                # from its first message all the same, and a lone one's list has no other key
                # to lend (bench point 2's prompts kept ~50 kB each for nothing, new memory a
                # request: page faults)
                return [first]
            whole = orjson.dumps(messages)
        except (orjson.JSONEncodeError, UnicodeEncodeError):
            return None
        keys = [first]
        chats = self._chats.pop(first, None) or []
        for i, (old, old_keys) in enumerate(chats):
            if whole == old:  # a retry, a sibling sent again
                keys = old_keys
            elif (
                len(whole) > len(old)
                and whole[len(old) - 1] == _COMMA
                and whole.startswith(memoryview(old)[:-1])
            ):
                keys = old_keys[:]  # the old list's messages, the same bytes, then more
            else:
                continue
            self._chat_bytes -= len(chats.pop(i)[0])  # the new list (same or longer) replaces it
            self.stats.message_keys_reused += len(keys)
            break
        key = keys[-1]
        for message in messages[len(keys) :]:
            key = digest(key + orjson.dumps(message))  # JSON already: cannot fail now
            keys.append(key)
        self._keep_chat(first, chats, whole, keys)
        return keys

    def _keep_chat(
        self, first: bytes, chats: list[tuple[bytes, list[bytes]]], whole: bytes, keys: list[bytes]
    ) -> None:
        if len(whole) <= self.max_message_keys_bytes:
            chats.insert(0, (whole, keys))
            self._chat_bytes += len(whole)
            if len(chats) > CHATS_PER_FIRST_MESSAGE:
                self._chat_bytes -= len(chats.pop()[0])
        if chats:
            self._chats[first] = chats
        while self._chat_bytes > self.max_message_keys_bytes:
            _, dropped = self._chats.popitem(last=False)
            self._chat_bytes -= sum(len(chat) for chat, _ in dropped)

    def _keep(self, salt: str, piece: str, ids: bytes) -> None:
        """Keep a segment's ids (native uint32 bytes)."""
        tokens = len(ids) >> 2
        if tokens > self.max_cached_tokens:
            return
        self._cache[(salt, piece)] = ids
        self._cached_tokens += tokens
        while self._cached_tokens > self.max_cached_tokens:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= len(dropped) >> 2

    def _keep_prefix(self, key: bytes, ids: array.array[int]) -> None:
        if len(ids) > self.max_prefix_tokens:
            return
        old = self._prefixes.pop(key, None)
        if old is not None:
            self._prefix_tokens -= len(old)
        self._prefixes[key] = array.array("I", ids)
        self._prefix_tokens += len(ids)
        while self._prefix_tokens > self.max_prefix_tokens:
            _, dropped = self._prefixes.popitem(last=False)
            self._prefix_tokens -= len(dropped)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def prefix_cached_tokens(self) -> int:
        return self._prefix_tokens


def word_cuts(text: str, start: int, stop: int, every: int) -> list[int]:
    """Positions in (start, stop) about `every` characters apart, each right before a space
    that follows a non-space and precedes a non-space: where GPT-2-style pre-tokenizers
    (` ?\\p{L}+`, ` ?\\p{N}+`, ...) always begin a piece, since no pattern starting at a
    non-space crosses a space and the pieces after it see the same text."""
    out = []
    i = start + every
    while i < stop - 1:
        i = text.find(" ", i, stop - 1)
        if i < 0:
            break
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            out.append(i)
            i += every
        else:
            i += 1
    return out


def chunks_concatenate(tokenizer: ModelTokenizer, every: int) -> bool:
    """Whether the probes (`_CHUNK_PROBES`) encode the same whole and cut at every word
    boundary, each piece apart: the condition for cutting long segments."""
    for probe in _CHUNK_PROBES:
        cuts = word_cuts(probe, 0, len(probe), 1)
        if not cuts:
            return False
        bounds = [0, *cuts, len(probe)]
        pieces = [probe[a:b] for a, b in itertools.pairwise(bounds)]
        joined = [i for ids in tokenizer.encode_many(pieces) for i in ids]
        if joined != tokenizer.encode(probe):
            return False
    return every > 0


__all__ = ["ChatTemplateError", "PromptTokens", "TokenizeStats"]
