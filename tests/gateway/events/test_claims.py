"""Issue 45, item 9: an engine that lies in its KV events. Every engine receives each routed
tenant's `cache_salt`; one that announces blocks under another tenant's salt, for a chain the
gateway routed elsewhere, must not pull that tenant's requests onto itself."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from cachemap.events import EventIndex, precise_keys
from cachemap.tokenizer import ModelTokenizer
from gateway.events.claims import CHECKPOINT_BLOCKS
from gateway.events.intake import EventIntake, EventsConfig
from gateway.events.metrics import precise_families
from gateway.events.precise import PreciseKeys, PromptTokens
from loadgen.engine.tokenizer import MODEL_DIR

HONEST, LIAR = "http://honest:8000", "http://liar:8000"
SALT = "tenant-x-salt"
PROMPT = list(range(2000, 2000 + 16 * 40))  # tenant X's 40-block hot prefix


def stored(ids: list[int], num_blocks: int) -> bytes:
    """One batch announcing the first `num_blocks` blocks of `ids` under X's salt."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(range(1, num_blocks + 1)),
        "parent_block_hash": None,
        "token_ids": ids[: 16 * num_blocks],
        "block_size": 16,
        "medium": "GPU",
        "extra_keys": [[SALT]],
    }
    payload: bytes = msgspec.msgpack.encode([time.time(), [event]])
    return payload


async def test_a_claim_of_a_chain_never_routed_there_does_not_attract_its_tenant() -> None:
    index = EventIndex()
    config = EventsConfig(endpoints={HONEST: "inproc://honest", LIAR: "inproc://liar"})
    intake = EventIntake(config, index, lambda: [HONEST, LIAR])
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), index, intake)
    intake.refresh()
    try:
        keys = precise_keys(PROMPT, SALT, 16)
        precise.speculate(HONEST, None, keys)  # the gateway routed X's prefix to HONEST
        precise.speculate(LIAR, None, keys[:10])  # and only a short X request to LIAR
        index.sweep(HONEST, time.time() + 3600)  # (the speculative entries expired)
        index.sweep(LIAR, time.time() + 3600)
        [honest], [liar] = intake.feeds(HONEST), intake.feeds(LIAR)
        await honest.receive(0, stored(PROMPT, 30))  # it evicted the prefix's last 10 blocks
        await liar.receive(0, stored(PROMPT, 40))  # the lie: all 40 blocks
        view = precise.view(keys, [HONEST, LIAR])
        # the honest engine's events stand; the liar's claim is routed on the prediction
        assert view.overlap == {HONEST: 30}
        assert HONEST in view.live and LIAR not in view.live
        assert precise.placed.unplaced_claims == {LIAR: 1}
        # counted per engine on the admin port's /metrics
        [claims] = [f for f in precise_families(precise, None) if f.name.endswith("claims")]
        assert [(s.labels, s.value) for s in claims.samples] == [({"domain": LIAR}, 1)]
        # a claim within what was placed (plus one window) is confirmed as before
        short = keys[:CHECKPOINT_BLOCKS]
        assert precise.view(short, [HONEST, LIAR]).overlap == {
            HONEST: CHECKPOINT_BLOCKS,
            LIAR: CHECKPOINT_BLOCKS,
        }
        # a chain this gateway placed nowhere (another gateway's, a direct client's): the
        # events stand, as before (the limit of what one gateway can weigh)
        other = list(range(9000, 9000 + 16 * 4))
        await liar.receive(1, stored(other, 4))
        assert precise.view(precise_keys(other, SALT, 16), [HONEST, LIAR]).overlap == {LIAR: 4}
        assert precise.placed.unplaced_claims == {LIAR: 1}
    finally:
        await intake.close()
