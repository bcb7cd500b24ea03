"""Pickers: turn weighted scores into a ranking."""

from __future__ import annotations

import random
from collections.abc import Mapping


def max_score_ranking(scores: Mapping[str, float], rng: random.Random) -> list[str]:
    """Replicas by score, best first; ties broken at random (GIE `max_score_picker`)."""
    tiebreak = {rid: rng.random() for rid in sorted(scores)}
    return sorted(scores, key=lambda rid: (-scores[rid], tiebreak[rid]))
