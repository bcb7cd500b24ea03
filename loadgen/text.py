"""Deterministic synthetic text with an exact token count under the simulated engine's tokenizer.

Every word is one of the tokenizer's single-token words (" " + lowercase letters, see
`loadgen.engine.tokenizer`): a concatenation of n of them is exactly n tokens wherever it stands,
as long as no letter follows it directly, so `words(seed, n)` is n tokens and equal (seed, n)
give byte-identical text.
"""

from __future__ import annotations

import random

from loadgen.engine.tokenizer import default_tokenizer


def words(seed: int | str, num_tokens: int) -> str:
    rng = random.Random(str(seed))
    return "".join(rng.choices(default_tokenizer().words, k=num_tokens))
