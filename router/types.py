"""The snapshot a routing decision sees."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Replica:
    """One engine replica as the router sees it at decision time.

    `pending_prefill_tokens` is the prefill work the gateway has sent to the replica whose first
    token has not come back yet: what a new request queues behind (vLLM schedules FCFS).
    `foreign_prefill_tokens` is what other gateways queued there, seen through the engine's
    metrics; every default is "unknown / none", so a snapshot without signals means what it
    meant before they existed.
    """

    id: str
    healthy: bool = True
    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    # -- engine load signals (issue 9): what the engine's /metrics said at the last scrape ----
    engine_num_waiting: float = 0.0
    """Requests queued at the engine (scheduled by no one yet), from every gateway."""
    own_num_waiting: float = 0.0
    """This gateway's requests on the replica that were still before their first token when
    that scrape answered: the part of `engine_num_waiting` already in `pending_prefill_tokens`
    (an over-count when one of them was already prefilling, so the foreign part errs low)."""
    foreign_request_tokens: float = 0.0
    """Prefill tokens assumed per request another gateway queued (this gateway's mean uncached
    tokens per request: gateways behind one Service see the same traffic)."""

    @property
    def foreign_prefill_tokens(self) -> float:
        """Prefill work other gateways have queued on the replica: the engine's waiting
        requests this gateway did not send, each at `foreign_request_tokens`. 0 without
        engine signals, so a lone gateway's estimate is unchanged."""
        foreign = self.engine_num_waiting - self.own_num_waiting
        return foreign * self.foreign_request_tokens if foreign > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about one request.

    `overlap[replica]` is the number of leading blocks of the prompt cached there (absent = 0);
    `tokens_per_block` converts blocks to tokens, so uncached work is counted in tokens.
    """

    num_blocks: int
    num_prompt_tokens: float
    overlap: Mapping[str, int] = field(default_factory=dict)
    tokens_per_block: float = 64.0
    affinity_key: bytes = b""
    sequence: int = 0

    def uncached_tokens(self, replica: str) -> float:
        cached = self.overlap.get(replica, 0) * self.tokens_per_block
        return max(self.num_prompt_tokens - cached, 0.0)

    def estimated_work(self, replica: Replica) -> float:
        """Prefill tokens that must run on `replica` before this request's first token: this
        gateway's pending prefills, other gateways' queued ones, and this request's own."""
        return (
            replica.pending_prefill_tokens
            + replica.foreign_prefill_tokens
            + self.uncached_tokens(replica.id)
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """A ranking of replicas, best first (the rest are fallbacks for retries).

    `reason` says why the first was chosen: "prefix" (longest match within the load bound),
    "load_bound" (a longer match existed but was over the bound), "no_match", or the policy
    name for the baselines.
    """

    ranking: tuple[str, ...]
    reason: str
    matched_blocks: int = 0

    @property
    def replica(self) -> str:
        return self.ranking[0]
