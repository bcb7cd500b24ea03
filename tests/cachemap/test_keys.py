"""Properties of the salted block-hash chain."""

from __future__ import annotations

import mmh3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachemap.keys import TAG_BYTES, affinity_key, chain_hashes, hash_prompt, root_hash

BLOCK = 16
salts = st.binary(min_size=1, max_size=32)
data = st.binary(min_size=0, max_size=20 * BLOCK)


@given(salts, data, data)
def test_equal_prefixes_give_equal_leading_hashes(salt: bytes, a: bytes, b: bytes) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = hash_prompt(a, salt, "m", BLOCK), hash_prompt(b, salt, "m", BLOCK)
    shared_blocks = common // BLOCK
    assert ha[:shared_blocks] == hb[:shared_blocks]
    if shared_blocks < min(len(ha), len(hb)):
        assert ha[shared_blocks] != hb[shared_blocks]


@given(salts, st.binary(min_size=BLOCK, max_size=12 * BLOCK), st.data())
def test_a_change_at_byte_k_changes_every_hash_from_its_block_on(
    salt: bytes, prompt: bytes, draw: st.DataObject
) -> None:
    k = draw.draw(st.integers(0, len(prompt) - 1))
    changed = bytearray(prompt)
    changed[k] ^= 0xFF
    before, after = (
        hash_prompt(prompt, salt, "m", BLOCK),
        hash_prompt(bytes(changed), salt, "m", BLOCK),
    )
    first = k // BLOCK
    assert before[:first] == after[:first]
    assert all(x != y for x, y in zip(before[first:], after[first:], strict=True))


@given(salts, salts, st.binary(min_size=BLOCK, max_size=10 * BLOCK))
def test_different_salts_share_nothing(s1: bytes, s2: bytes, prompt: bytes) -> None:
    if s1 == s2:
        return
    assert not set(hash_prompt(prompt, s1, "m", BLOCK)) & set(hash_prompt(prompt, s2, "m", BLOCK))


def test_different_models_share_nothing() -> None:
    prompt = b"x" * (4 * BLOCK)
    assert not set(hash_prompt(prompt, b"s", "a", BLOCK)) & set(
        hash_prompt(prompt, b"s", "b", BLOCK)
    )


def test_only_full_blocks_are_hashed() -> None:
    root = root_hash(b"s", "m")
    assert chain_hashes(b"a" * (BLOCK - 1), root, BLOCK) == []
    assert len(chain_hashes(b"a" * (3 * BLOCK + 5), root, BLOCK)) == 3
    # the trailing partial block does not change the full blocks' hashes
    assert chain_hashes(b"a" * (3 * BLOCK), root, BLOCK) == chain_hashes(
        b"a" * (3 * BLOCK) + b"tail", root, BLOCK
    )
    with pytest.raises(ValueError, match="block_bytes"):
        chain_hashes(b"abc", root, 0)


def test_affinity_key_names_the_first_k_blocks() -> None:
    root = root_hash(b"s", "m")
    prompt = bytes(range(200))
    hashes = chain_hashes(prompt, root, BLOCK)
    assert affinity_key(prompt, root, hashes, 4, BLOCK) == hashes[3]
    # a different tail after block 4 keeps the key; a change inside the first 4 blocks moves it
    other = prompt[: 4 * BLOCK] + b"different tail" * 5
    assert affinity_key(other, root, chain_hashes(other, root, BLOCK), 4, BLOCK) == hashes[3]
    moved = b"!" + prompt[1:]
    assert affinity_key(moved, root, chain_hashes(moved, root, BLOCK), 4, BLOCK) != hashes[3]
    short = b"short"
    assert affinity_key(short, root, [], 4, BLOCK) != affinity_key(b"shorT", root, [], 4, BLOCK)


def _by_definition(data: bytes, root: bytes, block: int, parent: bytes | None) -> list[bytes]:
    """The module docstring's chain, a block at a time (what `chain_hashes` must equal however
    it cuts the blocks)."""
    out: list[bytes] = []
    last, tag = parent, parent[:TAG_BYTES] if parent is not None else b""
    for start in range(0, len(data) - block + 1, block):
        piece = data[start : start + block]
        if last is None:
            last = mmh3.mmh3_x64_128_digest(root + piece)
            tag = last[:TAG_BYTES]
        else:
            last = tag + mmh3.mmh3_x64_128_digest(last + piece)[TAG_BYTES:]
        out.append(last)
    return out


@given(
    st.binary(max_size=3000),
    st.sampled_from([1, 3, 16, 64, 256, 1024]),
    st.none() | st.binary(min_size=16, max_size=16),
)
def test_the_chain_is_its_definition(prompt: bytes, block: int, parent: bytes | None) -> None:
    root = root_hash(b"salt", "model")
    assert chain_hashes(prompt, root, block, parent=parent) == _by_definition(
        prompt, root, block, parent
    )


def test_the_keys_do_not_change() -> None:
    """Known answers: other gateways (and Redis) hold these keys, so a faster chain must give
    the same bytes (computed before the chain was cut by `struct.iter_unpack`)."""
    root = root_hash(b"tenant-salt", "kvgate-sim-8b")
    assert root.hex() == "6d1364852834efa6b17523641f6df473"
    chain = chain_hashes(bytes(range(256)) * 5, root, 256)
    assert [h.hex() for h in chain] == [
        "7b0e621ab6a5c763166192c215d872eb",
        "7b0e621ab6a5906281a8add8a3c8ca2e",
        "7b0e621ab6a5f7dfc86e435be15cdf06",
        "7b0e621ab6a5c48f7c0ace1b7f486aeb",
        "7b0e621ab6a5a1d43bf6cb1a52987f6b",
    ]
    tail = chain_hashes(bytes(range(256)) * 2 + b"x", root, 256, parent=chain[2])
    assert tail == chain[3:]
