"""What the gateway placed on each cache domain: the measure of an engine's KV event claims
(issue 45, item 9).

Every engine receives each routed tenant's `cache_salt`, so a compromised one can announce
blocks under tenant X's salt for X's hot prefixes and pull X's requests (and prompts) onto
itself. An honest engine holds a chain because a gateway sent it there; so a domain's claim is
confirmed only as deep as this gateway placed that chain on it, and a claim past that counts
as a prediction at most: the request is routed for that replica on the directory's prediction
(what the gateway's placements say), as for an engine without events. Such claims are counted
per domain (`kvgate_events_unplaced_claims`) and logged.

Kept per domain: the own keys of every `CHECKPOINT_BLOCKS`-th block (from block 0) of each
chain placed there, at most `DEFAULT_MAX_CHECKPOINTS`, oldest dropped first. Own keys chain (a
key names its whole prefix), so a checkpoint held confirms every block up to it and the window
after it: a claim of depth d is confirmed up to the deepest placed checkpoint at or before
block d-1, plus one window. An engine may thus claim up to `CHECKPOINT_BLOCKS - 1` blocks past
what was placed, under a prefix it was given: what a turn's own continuation adds.

The cost on the honest path: a chain another gateway (or this one before a restart) placed is
routed on the prediction until this gateway places it again; with the shared directory the
prediction holds every gateway's placements.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from cachemap.keys import BlockHash

log = logging.getLogger(__name__)

CHECKPOINT_BLOCKS = 16
"""A checkpoint every 16 blocks (256 tokens): 1/16 of a chain's keys kept, a claim confirmed
to within one window of what was placed."""
DEFAULT_MAX_CHECKPOINTS = 16_384
"""Checkpoints kept per domain (~1.5 MB): 262,144 placed blocks, above an engine's KV capacity
today (a confirmed chain that aged out is routed on the prediction until placed again)."""
LOG_EVERY = 1000
"""An engine's unplaced claims are logged at the first and every thousandth."""


class PlacedChains:
    """Per domain, the checkpoints of the chains placed there (module docstring)."""

    def __init__(self, max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS) -> None:
        self.max_checkpoints = max_checkpoints
        self.unplaced_claims: Counter[str] = Counter()
        """domain -> requests whose match there was deeper than what was placed."""
        self._placed: dict[str, dict[BlockHash, None]] = {}

    def place(self, domain: str, keys: Sequence[BlockHash]) -> None:
        placed = self._placed.get(domain)
        if placed is None:
            placed = self._placed[domain] = {}
        for key in keys[::CHECKPOINT_BLOCKS]:
            placed.pop(key, None)  # the newest last: the oldest go first
            placed[key] = None
        while len(placed) > self.max_checkpoints:
            del placed[next(iter(placed))]

    def confirmed(self, domain: str, keys: Sequence[BlockHash], depth: int) -> int:
        """How much of a claim of `depth` blocks of `keys` on `domain` was placed there."""
        placed = self._placed.get(domain)
        if placed is None or depth <= 0:
            return 0
        for at in range(
            (depth - 1) // CHECKPOINT_BLOCKS * CHECKPOINT_BLOCKS, -1, -CHECKPOINT_BLOCKS
        ):
            if keys[at] in placed:
                return min(depth, at + CHECKPOINT_BLOCKS)
        return 0

    def doubt(self, domain: str, depth: int, confirmed: int) -> None:
        """Count (and now and then log) a claim deeper than what was placed."""
        self.unplaced_claims[domain] += 1
        count = self.unplaced_claims[domain]
        if count == 1 or count % LOG_EVERY == 0:
            log.warning(
                "KV events of %s claim %d blocks of a chain placed there for %d (%d such "
                "claims): routed on the prediction, not on the claim",
                domain,
                depth,
                confirmed,
                count,
            )

    def forget(self, domain: str) -> None:
        self._placed.pop(domain, None)
