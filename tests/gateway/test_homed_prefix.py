"""`gateway.pipeline.keying.homed_prefix`: the blocks a conversation's home is recorded under
(the prompt less its last 64 tokens), and a next prompt that shares all but those finds it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachemap.affinity import ConversationAffinity
from cachemap.keys import chain_hashes, root_hash
from gateway.pipeline.keying import AFFINITY_TAIL_TOKENS, homed_prefix

ROOT = root_hash(b"salt", "model")


def chain(data: bytes, width: int = 64) -> list[bytes]:
    return chain_hashes(data, ROOT, width)


def test_the_tail_is_64_tokens_of_blocks_and_a_short_prompt_keeps_it() -> None:
    hashes = chain(bytes(range(256)) * 10)  # 40 blocks
    assert homed_prefix(hashes, 16.0) == hashes[: -AFFINITY_TAIL_TOKENS // 16]
    assert homed_prefix(hashes, 64.0) == hashes[:-1]  # approximate mode's ~64 tokens a block
    assert homed_prefix(hashes[:7], 16.0) == hashes[:7]  # fewer than 2 x 4 blocks: all kept
    assert homed_prefix(hashes[:8], 16.0) == hashes[:4]


@given(
    st.integers(min_value=8, max_value=60),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=0, max_value=30),
)
def test_a_next_prompt_that_differs_in_its_last_blocks_finds_the_home(
    blocks: int, differ: int, grown: int
) -> None:
    """Turn 1's last `differ` blocks (<= 64 tokens of 16-token blocks) are not in turn 2's
    chain: turn 2 still finds turn 1's home, at the depth it was recorded at."""
    first = b"".join(i.to_bytes(64, "big") for i in range(blocks))
    second = first[: (blocks - differ) * 64] + b"\xff" * 64 * (differ + grown)
    affinity = ConversationAffinity()
    homed = homed_prefix(chain(first), 16.0)
    affinity.record(homed, "r1")
    home = affinity.lookup(chain(second))
    assert home is not None and home.replica == "r1" and home.depth_blocks == len(homed)
