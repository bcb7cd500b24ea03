"""Properties of the salted block-hash chain."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachemap.keys import affinity_key, chain_hashes, hash_prompt, root_hash

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
