"""The compiled loops (`cachemap/_native.pyx`, where built) against their pure definitions.

Each test runs on every implementation at hand: the pure one always, the compiled one when it
is built (whatever `KVGATE_PURE` says: this file compares them). The rest of tests/cachemap
runs on what the process chose (`make test` runs it a second time with `KVGATE_PURE=1`)."""

from __future__ import annotations

import array
import importlib
import sys
import types
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import mmh3
import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cachemap
from cachemap import events, keys, native
from cachemap.events import (
    CPU,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EngineHash,
    EventIndex,
    precise_keys,
)
from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.memory import MemoryIndex, OrderedLru
from gateway.events import decode, words
from gateway.events.texts import common_prefix
from gateway.events.words import WordIds


def _compiled() -> Any:
    try:
        return importlib.import_module("cachemap._native")
    except ImportError:
        return None


COMPILED = _compiled()
LRUS: list[Callable[[], Any]] = [OrderedLru] + ([COMPILED.Lru] if COMPILED is not None else [])
CHAINS: list[Callable[[bytes, bytes, int, bytes | None], list[bytes]]] = [keys._chain] + (
    [COMPILED.chain] if COMPILED is not None else []
)
UNPACKS: list[Callable[[Any], Any]] = [decode.unpack_u32] + (
    [COMPILED.unpack_u32] if COMPILED is not None else []
)
PREFIXES: list[Callable[[str, str], int]] = [common_prefix] + (
    [COMPILED.common_prefix] if COMPILED is not None else []
)


def test_kvgate_pure_chooses_the_pure_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_PURE", "1")
    assert native.load() is None
    monkeypatch.setenv("KVGATE_PURE", "0")
    assert native.load() is COMPILED


def test_a_build_older_than_one_of_the_compiled_forms_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkout's `.so` from before a form was added (`native.NAMES`): pure, not an import
    that fails on the missing name."""
    stale = types.ModuleType("cachemap._native")
    stale.chain = keys._chain  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cachemap._native", stale)
    monkeypatch.setattr(cachemap, "_native", stale, raising=False)
    monkeypatch.delenv("KVGATE_PURE", raising=False)
    assert native.load() is None
    for name in native.NAMES:
        setattr(stale, name, object())
    assert native.load() is stale


@pytest.mark.parametrize("chain", CHAINS)
def test_the_first_key_is_murmurhash3_of_any_length(chain: Any) -> None:
    """Every tail length of MurmurHash3's last 16-byte block, and roots of any length."""
    data = bytes(range(256)) * 2
    for size in range(1, 300):
        for root in (b"", b"r" * 7, root_hash(b"s", "m")):
            assert chain(data, root, size, None)[0] == mmh3.mmh3_x64_128_digest(root + data[:size])


@pytest.mark.parametrize("chain", CHAINS)
@given(
    st.binary(min_size=1, max_size=3000),
    st.binary(max_size=40),
    st.sampled_from([1, 3, 15, 16, 17, 64, 256, 1024]),
    st.none() | st.binary(min_size=16, max_size=16),
)
def test_the_chain_is_the_pure_chain(
    chain: Any, prompt: bytes, root: bytes, block: int, parent: bytes | None
) -> None:
    if len(prompt) < block:
        return
    assert chain(prompt, root, block, parent) == keys._chain(
        prompt, BlockHash(root), block, None if parent is None else BlockHash(parent)
    )


def test_chain_hashes_takes_a_view_as_bytes() -> None:
    data = bytes(range(256)) * 4
    root = root_hash(b"s", "m")
    assert chain_hashes(memoryview(data), root, 256) == keys._chain(data, root, 256, None)  # type: ignore[arg-type]


class Model:
    """An LRU as a list, least recent first: what an `Lru`'s every method must answer."""

    def __init__(self) -> None:
        self.items: list[tuple[bytes, float]] = []

    def get(self, key: bytes) -> float | None:
        return next((used for k, used in self.items if k == key), None)

    def touch_chain(self, hashes: list[bytes], now: float) -> None:
        for block in reversed(hashes):
            self.items = [(k, u) for k, u in self.items if k != block] + [(block, now)]

    def walk(self, hashes: list[bytes], expired_before: float, first: float) -> tuple[int, float]:
        depth, last = 0, first
        for block in hashes:
            used = self.get(block)
            if used is None or used <= expired_before:
                break
            depth, last = depth + 1, used
        return depth, last

    def trim(self, capacity: int, expired_before: float) -> None:
        while self.items and (len(self.items) > capacity or self.items[0][1] <= expired_before):
            self.items.pop(0)

    def discard_all(self, hashes: list[bytes]) -> None:
        self.items = [(k, u) for k, u in self.items if k not in hashes]

    def release(self, budget: int) -> int:
        done = min(budget, len(self.items))
        self.items = self.items[: len(self.items) - done]
        return done

    def newest_first(self, since: float | None) -> list[tuple[bytes, float]]:
        out = []
        for k, u in reversed(self.items):
            if since is not None and u < since:
                break
            out.append((k, u))
        return out


# keys of every length around the compiled table's 16 inline bytes, some sharing 16-byte prefixes
_KEYS = [b"", b"a", b"b" * 15, b"c" * 16, b"d" * 17, b"p" * 16 + b"1", b"p" * 16 + b"2"] + [
    f"k{i}".encode() * (1 + i % 9) for i in range(40)
]
_chains = st.lists(st.sampled_from(_KEYS), max_size=12, unique=True)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("touch"), _chains, st.integers(0, 50)),
        st.tuples(st.just("trim"), st.integers(0, 40), st.integers(-1, 50)),
        st.tuples(st.just("discard"), _chains),
        st.tuples(st.just("release"), st.integers(0, 6)),
        st.tuples(st.just("walk"), _chains, st.integers(-1, 50)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("make", LRUS)
@settings(max_examples=300)
@given(_OPS)
def test_an_lru_answers_as_the_list_model(make: Any, ops: list[tuple[Any, ...]]) -> None:
    lru, model = make(), Model()
    now = 0.0
    for op, *args in ops:
        if op == "touch":
            now += args[1]
            lru.touch_chain(args[0], now)
            model.touch_chain(args[0], now)
        elif op == "trim":
            lru.trim(args[0], float(args[1]))
            model.trim(args[0], float(args[1]))
        elif op == "discard":
            lru.discard_all(args[0])
            model.discard_all(args[0])
        elif op == "release":
            assert lru.release(args[0]) == model.release(args[0])
        elif args[0]:
            expired = float(args[1])
            assert lru.walk(args[0], expired, -5.0) == model.walk(args[0], expired, -5.0)
        assert len(lru) == len(model.items)
        assert lru.newest_first() == model.newest_first(None)
        assert lru.newest_first(now - 10) == model.newest_first(now - 10)
        assert all(lru.get(k) == model.get(k) for k in _KEYS)


@pytest.mark.parametrize("make", LRUS)
def test_an_lru_grows_and_compacts_its_order_in_order(make: Any) -> None:
    """Thousands of touches through one LRU (its table rebuilt, its log compacted many times):
    the order is still the model's."""
    lru, model = make(), Model()
    blocks = [f"b{i}".encode() for i in range(300)]
    for step in range(200):
        chain_ = blocks[step % 37 : step % 37 + 1 + step % 50]
        lru.touch_chain(chain_, float(step))
        model.touch_chain(chain_, float(step))
        lru.trim(120, float(step - 40))
        model.trim(120, float(step - 40))
    assert lru.newest_first() == model.newest_first(None)
    held = [k for k, _ in model.items]
    assert lru.bisect(held[::-1][:5], -1.0, 0.0) == model.walk(held[::-1][:5], -1.0, 0.0)


_INDEX_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("record"), st.sampled_from("abcd"), st.integers(0, 40), st.integers(0, 9)
        ),
        st.tuples(st.just("drop"), st.sampled_from("abcd"), st.integers(0, 40), st.integers(0, 9)),
        st.tuples(st.just("forget"), st.sampled_from("abcd")),
        st.tuples(st.just("expire"), st.sampled_from("abcd"), st.integers(0, 30)),
        st.tuples(st.just("capacity"), st.sampled_from("abcd"), st.none() | st.integers(1, 80)),
    ),
    max_size=40,
)


@settings(max_examples=200)
@given(_INDEX_OPS, st.booleans())
def test_an_index_on_the_compiled_lru_answers_as_on_the_pure_one(
    ops: list[tuple[Any, ...]], whole_chains: bool
) -> None:
    clock = [1000.0]
    prompts = [chain_hashes(bytes([p]) * 16 * 45, root_hash(b"s", "m"), 16) for p in range(3)]
    pair = [
        MemoryIndex(
            ttl_s=60, capacity_blocks=90, clock=lambda: clock[0], whole_chains=whole_chains, lru=lru
        )
        for lru in LRUS
    ]
    for op, replica, *args in ops:
        clock[0] += 1
        for index in pair:
            if op == "record":
                index.record(replica, prompts[args[1] % 3][: args[0]])
            elif op == "drop":
                index.drop(replica, prompts[args[1] % 3][args[0] : args[0] + 3])
            elif op == "forget":
                index.forget(replica)
            elif op == "expire":
                index.expire(replica, clock[0] - args[0])
            else:
                index.set_capacity(replica, args[0])
        answers = [
            ([index.lookup_detail(p) for p in prompts], [index.entries(r) for r in "abcd"])
            for index in pair
        ]
        assert answers[0] == answers[-1]


MAPS: list[Callable[[], Any]] = [events.DomainMaps] + (
    [COMPILED.DomainTable] if COMPILED is not None else []
)
_BLOCKS = [bytes([i]) * 16 for i in range(10)] + [b"short", b"seventeen bytes!!"]
"""Own keys: a chain's 16 bytes, and shorter and longer ones (the table compares those apart)."""
_HASHES = [*range(1, 9), b"h1", b"h2", 2**64 - 1, -5, -(2**63), 2**64, -(2**63) - 1, 2**63]
"""Engine hashes: vLLM's unsigned ints, SGLang's signed ones, bytes, and ints at and past the
edges of 64 bits (the compiled table keeps [-2**63, 2**64) and the rest in a dict)."""
_MAP_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("hold"),
            st.lists(st.sampled_from(_HASHES), max_size=8),
            st.lists(st.sampled_from(_BLOCKS), max_size=8, unique=True),  # a chain: distinct
            st.sampled_from([1, 2, 4]),
            st.none() | st.sampled_from(_BLOCKS),
        ).filter(lambda op: op[4] not in op[2]),  # a parent outside its chain, as a hash's
        st.tuples(
            st.just("whole"), st.lists(st.sampled_from([*_HASHES, 99, b"unknown"]), max_size=8)
        ),
        st.tuples(
            st.just("tier"),
            st.lists(st.sampled_from([*_HASHES, 99]), max_size=8),
            st.sampled_from([1, 2, 4]),
        ),
    ),
    max_size=30,
)


@pytest.mark.parametrize("make", MAPS)
@settings(max_examples=250, deadline=None)
@given(_MAP_OPS, st.lists(st.sampled_from(_BLOCKS), max_size=8))
def test_a_domains_maps_answer_as_their_definition(
    make: Any, ops: list[tuple[Any, ...]], probe: list[bytes]
) -> None:
    """Stores (chains longer or shorter than their hashes, keys held on another tier already,
    under a held parent or none), whole and tiered removals (unknown hashes, repeats, two hashes of
    one key, parents that leave before their children): after every operation the same answers
    and the same maps as `DomainMaps` (dicts compared as dicts: the table keeps no order)."""
    mine, ref = make(), events.DomainMaps()
    for op in ops:
        if op[0] == "hold":
            _, hashes, chain_, tier, parent = op
            chain_ = chain_[: len(hashes)]
            if parent is not None and not ref.holds(parent):
                parent = None  # a store's parent comes from its engine hash: a key held
            assert mine.hold(tuple(hashes), chain_, tier, parent) == ref.hold(
                hashes, chain_, tier, parent
            )
        elif op[0] == "whole":
            assert mine.remove_whole(tuple(op[1])) == ref.remove_whole(op[1])
        else:
            assert mine.remove_tier(op[1], op[2]) == ref.remove_tier(op[1], op[2])
        assert mine.maps() == ref.maps()
        assert len(mine) == len(ref)
        assert mine.masks(probe) == ref.masks(probe)
        assert mine.holds_any(probe) == ref.holds_any(probe)
        assert mine.held_run(probe) == ref.held_run(probe)
        assert [mine.mask_of(k) for k in probe] == [ref.mask_of(k) for k in probe]
        assert [mine.holds(k) for k in probe] == [ref.holds(k) for k in probe]
        assert [mine.own_key(h) for h in _HASHES] == [ref.own_key(h) for h in _HASHES]


@pytest.mark.parametrize("make", MAPS)
def test_a_domain_table_grows_and_empties_its_records(make: Any) -> None:
    """Chains of 5,000 blocks stored and removed in turns: the table grows past its first
    size, reuses its emptied records, and answers as the dicts all along."""
    mine, ref = make(), events.DomainMaps()
    for turn in range(3):
        chain_ = [(turn * 10_000 + i).to_bytes(16, "big") for i in range(5_000)]
        hashes = [turn * 10_000 + i for i in range(5_000)]
        assert mine.hold(hashes, chain_, 1, None) == ref.hold(hashes, chain_, 1, None)
        assert mine.held_run(chain_) == ref.held_run(chain_) == 5_000
        odd = hashes[1::2]
        assert mine.remove_whole(odd) == ref.remove_whole(odd)
        assert mine.held_run(chain_) is None and ref.held_run(chain_) is None  # broken keys
        assert mine.maps() == ref.maps()
    everything = list(range(30_000))
    assert mine.remove_whole(everything) == ref.remove_whole(everything)
    assert mine.maps() == ref.maps() == ({}, {}, {}, {}, set()) and len(mine) == 0


class _Forms:
    """The event index's domain maps set to one form while applying (`events._MAPS`), the
    module's choice restored after."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __enter__(self) -> None:
        self.kept = events._MAPS
        events._MAPS = self.make

    def __exit__(self, *_: object) -> None:
        events._MAPS = self.kept


_SPLITS = (8, 3, 5, 0)
"""Branch b shares its first _SPLITS[b] blocks with branch 0 (branch 3 nothing): removals at a
branch point leave parents with held children."""


def _ids(branch: int, n: int) -> list[int]:
    return [
        (0 if i < _SPLITS[branch] else branch) * 10_000 + i * 16 + t
        for i in range(n)
        for t in range(16)
    ]


def _hash(domain: str, branch: int, i: int) -> EngineHash:
    """Engine hashes as ints on two domains, as bytes on the third."""
    value = 1 + (0 if i < _SPLITS[branch] else branch) * 100 + i
    return value if domain != "c" else value.to_bytes(8, "big")


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "remove", "clear"]),
        st.sampled_from("abc"),
        st.integers(0, 3),  # branch
        st.integers(0, 7),  # first block
        st.integers(1, 8),  # blocks
        st.sampled_from([GPU, GPU, GPU, CPU]),
        st.booleans(),  # a removal: with an unknown hash and a repeat
    ),
    max_size=50,
)


@pytest.mark.parametrize("make", MAPS)
@settings(max_examples=300, deadline=None)
@given(_EVENTS)
def test_an_event_index_on_the_compiled_loops_is_the_pure_one(
    make: Any, stream: list[tuple[str, str, int, int, int, int, bool]]
) -> None:
    """Random event streams on three domains: stores of any run (a repeat takes the stepped
    path), removals of any run with unknown hashes and repeats, wipes, CPU tiers (a domain
    with offloaded blocks removes key by key). After every event both indexes hold the same
    maps, count the same and answer every lookup alike, and a chain's held run, where found
    (no key of it broken, nothing offloaded), is all the domain holds of it (`speculate`
    makes its entries past the run unchecked)."""
    pure, other = EventIndex(), EventIndex()
    chains = [precise_keys(_ids(b, 8), "s", 16) for b in range(4)]
    for kind, domain, branch, at, count, tier, odd in stream:
        stop = min(8, at + count)
        event: CacheEvent
        if kind == "store":
            parent = _hash(domain, branch, at - 1) if at else None
            hashes = [_hash(domain, branch, i) for i in range(at, stop)]
            ids = _ids(branch, stop)[16 * at :]
            event = BlockStored(
                hashes, parent, ids, 16, tier=tier, cache_salt="s" if not at else None
            )
        elif kind == "remove":
            hashes = [_hash(domain, branch, i) for i in range(at, stop)]
            if odd:
                hashes += [hashes[0], 12_345]
            event = BlockRemoved(hashes, tier)
        else:
            event = AllBlocksCleared()
        with _Forms(events.DomainMaps):
            pure.apply(domain, event)
        with _Forms(make):
            other.apply(domain, event)
        assert other.stats == pure.stats
        assert other._domains.keys() == pure._domains.keys()
        for name, state in pure._domains.items():
            got = other._domains[name]
            assert got.maps.maps() == state.maps.maps()
            assert got.tier_counts == state.tier_counts
        for keys_ in chains:
            assert other.lookup(keys_, 1.0) == pure.lookup(keys_, 1.0)
            for name, state in other._domains.items():  # what `speculate` relies on
                run = other._held_run(name, state, keys_)
                assert run is None or not state.maps.holds_any(keys_[run:])


class DictTable:
    """A `WordTable` by its definition: a dict of every piece of each kind, `words._tail` over
    them."""

    def __init__(self) -> None:
        self.pieces: dict[str, bytes] = {}
        self.first: dict[str, bytes] = {}

    def put(self, key: str, ids: bytes, first: bool = False) -> None:
        (self.first if first else self.pieces)[key] = ids

    def get(self, key: str, first: bool = False) -> bytes | None:
        return (self.first if first else self.pieces).get(key)

    def tail(self, text: str) -> tuple[int, bytes, int] | None:
        return words._tail(self.pieces, text, self.first)


TABLES: list[Callable[[], Any]] = [DictTable] + (
    [COMPILED.WordTable] if COMPILED is not None else []
)
_WORDS = [
    *("a", "bb", "ccc", "Hello,", "eight_ch", "sixteen_chars_ok", "x" * 22, "y" * 23, "é", "日本"),
    *("", "\x7f", "\t", "\n", "seven\x7fby", "tab\there01"),
]
"""Pieces a table keeps (ASCII, up to 22 bytes: one, two and three of the 8 bytes `tail` reads
at a time) and does not (longer, not ASCII), and characters that keep a space from being a
cut, alone and inside a word."""
_TEXTS = st.lists(st.sampled_from([*_WORDS, " ", "  "]), max_size=14).map(" ".join)


def _fits(key: str, ids: bytes) -> bool:
    return key.isascii() and len(key) <= 22 and len(ids) <= 32


@pytest.mark.parametrize("make", TABLES)
@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_WORDS),
            st.lists(st.integers(0, 2**32 - 1), max_size=10),
            st.booleans(),
        ),
        max_size=20,
    ),
    st.lists(_TEXTS, max_size=6),
)
def test_a_word_table_answers_as_its_dict_where_its_pieces_fit(
    make: Any, puts: list[tuple[str, list[int], bool]], texts: list[str]
) -> None:
    """Pieces of every size put as first or later pieces (and put again: what no longer fits
    is no longer kept), then texts of every shape (spaces opening, closing, doubled;
    unprintable and non-ASCII characters): a piece is kept iff it fits, under its kind only,
    and a text's tail is its definition's wherever every piece fits, and None or its
    definition's without the first piece's ids elsewhere."""
    table, model = make(), DictTable()
    for key, ids, first in puts:
        table.put(key, array.array("I", ids).tobytes(), first)
        model.put(key, array.array("I", ids).tobytes(), first)
    for first, kept in ((False, model.pieces), (True, model.first)):
        for key, ids_ in kept.items():
            assert table.get(key, first) == (
                ids_ if _fits(key, ids_) or make is DictTable else None
            )
            if key not in (model.first if not first else model.pieces):
                assert table.get(key, not first) is None
    pieces = [w for w, _, _ in puts]
    for text in [*texts, *(" ".join(pieces[:k]) for k in range(len(puts))), " " + " ".join(pieces)]:
        answer, expected = table.tail(text), model.tail(text)
        if answer == expected:
            continue
        # a miss only for a piece the table cannot keep: a later one (None), the first (its
        # ids left to the caller)
        assert expected is not None
        head, *later = words.parts_of(text)
        if answer is None:
            assert not all(_fits(p, model.pieces[p]) for p in later)
            continue
        ids_ = model.pieces[head[1:]] if head[:1] == " " else model.first[head]
        assert expected == (0, ids_ + answer[1], answer[2])
        assert answer[0] == len(head) and not _fits(head.lstrip(" "), ids_)


def test_a_word_table_grows_and_keeps_every_piece() -> None:
    """Thousands of pieces (the table rebuilt many times), then one text of all of them."""
    for make in TABLES:
        table = make()
        pieces = [f"w{i}" for i in range(5000)]
        for i, piece in enumerate(pieces):
            table.put(piece, array.array("I", [i] * (1 + i % 8)).tobytes())
        text = "first " + " ".join(pieces)
        later = b"".join(array.array("I", [i] * (1 + i % 8)).tobytes() for i in range(5000))
        assert table.tail(text) == (5, later, 5001)
        table.put("first", array.array("I", [7, 7]).tobytes(), True)  # its first piece too
        assert table.tail(text) == (0, array.array("I", [7, 7]).tobytes() + later, 5001)


def _encode(pieces: Sequence[str]) -> list[list[int]]:
    """Ids that tell pieces apart, 1 to 10 of them (more than a `WordTable` slot keeps)."""
    return [
        [zlib.crc32(p.encode()) + j for j in range(1 + zlib.crc32(p.encode()) % 10)] for p in pieces
    ]


_WORD_OPS = st.lists(
    st.tuples(
        st.sampled_from(["ids", "ids_or_none", "missing"]),
        st.sampled_from(["s", "t"]),
        st.lists(
            st.lists(st.sampled_from([*_WORDS, "a", "bb", " ", "ccc", "dd"]), max_size=30).map(
                " ".join
            ),
            min_size=1,
            max_size=3,
        ),
    ),
    max_size=12,
)


@pytest.mark.parametrize("make", TABLES)
@settings(max_examples=300, deadline=None)
@given(_WORD_OPS, st.sampled_from([4, 16, 1000]), st.booleans())
# a promotion from the old generation turned the young one over mid-call: `missing_or_whole`
# read the table it had when it started
@example([("ids", "s", ["a bb a"]), ("missing", "s", ["", "a bb", "a a"])], 4, True)
def test_the_word_cache_on_a_word_table_answers_as_without_one(
    make: Any, ops: list[tuple[str, str, list[str]]], max_pieces: int, loose: bool
) -> None:
    """Texts through `ids`, `ids_or_none` and `missing_or_whole` then `add` (the gateway's
    big texts), two salts, bounds that turn the young generation old every few pieces: the
    cache with each table gives the ids, the missing pieces, the whole texts and the counts
    of the cache without one."""
    with_table = WordIds(_encode, max_pieces, loose, table=make)
    without = WordIds(_encode, max_pieces, loose, table=None)
    for op, salt, texts in ops:
        answers = []
        for cache in (with_table, without):
            if op == "missing":
                missing, whole = cache.missing_or_whole(texts, salt, len(texts) > 1)
                cache.add(salt, missing, _encode(missing))
                answer: Any = (missing, whole, [cache.ids_or_none(t, salt) for t in texts])
            else:
                answer = [getattr(cache, op)(t, salt) for t in texts]
            answers.append((answer, cache.stats, cache.size))
        assert answers[0] == answers[1]


def _msgpack_int(value: int, form: int) -> bytes:
    """`value` in one of msgpack's integer forms (0: the shortest, as msgspec writes it; 1-4:
    uint 8-64; 5-8: int 8-64), or the shortest when `value` does not fit the one asked."""
    forms = [(0xCC + i, 1 << i, False) for i in range(4)] + [
        (0xD0 + i, 1 << i, True) for i in range(4)
    ]
    if form:
        tag, size, signed = forms[form - 1]
        try:
            return bytes([tag]) + value.to_bytes(size, "big", signed=signed)
        except OverflowError:
            pass
    return msgspec.msgpack.encode(value)


def _msgpack_array_header(n: int, form: int) -> bytes:
    """An array of `n` in one of its header forms (fixarray where it fits, array 16, 32)."""
    if form == 0 and n < 16:
        return bytes([0x90 | n])
    if form <= 1 and n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_ELEMENTS = (
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 8)).map(lambda t: _msgpack_int(*t))
    | st.tuples(st.integers(-(2**63), 2**64 - 1), st.integers(0, 8)).map(lambda t: _msgpack_int(*t))
    | st.sampled_from([b"\xc2", b"\xc3", b"\xc0", b"\xcb" + bytes(8), b"\xa1x", b"\x90", b"\xff"])
)


@pytest.mark.parametrize("unpack", UNPACKS)
@settings(max_examples=500)
@given(
    st.lists(_ELEMENTS, max_size=40), st.integers(0, 2), st.integers(-3, 2), st.binary(max_size=8)
)
def test_unpacking_token_ids_is_its_definition(
    unpack: Any, elements: list[bytes], header: int, count: int, junk: bytes
) -> None:
    """Arrays of every integer form, true and false, values out of 0..2**32-1 (negative, too
    large), other types; the count in each header form, off by a few (the bytes run out, or
    are left over), bytes that are no array: as `array("I", msgspec.msgpack.decode(raw))`."""
    n = max(len(elements) + count, 0)
    for raw in (
        _msgpack_array_header(n, header) + b"".join(elements),
        junk,
        junk + _msgpack_array_header(n, header) + b"".join(elements),
    ):
        assert unpack(raw) == decode.unpack_u32(raw)
        assert unpack(raw) is None or unpack(raw).typecode == "I"
    exact = _msgpack_array_header(len(elements), header) + b"".join(elements)
    valid = msgspec.msgpack.decode(exact)
    expected = decode.unpack_u32(exact)
    if all(type(v) in (int, bool) and 0 <= v < 2**32 for v in valid):
        assert expected == array.array("I", valid)
    else:
        assert expected is None
    raw = msgspec.msgpack.decode(
        msgspec.msgpack.encode([msgspec.Raw(exact)]), type=list[msgspec.Raw]
    )[0]
    assert unpack(raw) == expected  # a msgspec.Raw as the fast layouts keep the ids


_CHARS = st.sampled_from(["a", "b", "é", "ÿ", "Ā", "日", "\U0001f600", "\x00"])
"""Characters of every width CPython stores a text in (1, 2 and 4 bytes), so two texts may
share a prefix in two kinds."""


@pytest.mark.parametrize("prefix", PREFIXES)
@settings(max_examples=300)
@given(
    st.lists(_CHARS, max_size=40).map("".join),
    st.lists(_CHARS, max_size=40).map("".join),
    st.integers(0, 40),
)
def test_common_prefix_is_the_longest_shared_beginning_in_any_kind(
    prefix: Callable[[str, str], int], a: str, b: str, cut: int
) -> None:
    """Texts of every kind and length (a shared start, then anything; one the other's prefix;
    a difference in any byte of an 8-byte step): the length of their longest common prefix."""
    b = a[:cut] + b
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    expected = min(len(a), len(b)) if shared is None else shared
    assert prefix(a, b) == prefix(b, a) == expected
    assert prefix(a, a + b) == len(a)
