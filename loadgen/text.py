"""Deterministic synthetic text with an exact token count under the simulated tokenizer.

Every word is " " + 1–7 letters: one token each for `loadgen.engine.tokenizer`, so `words(seed, n)`
is exactly n tokens, and equal (seed, n) give byte-identical text.
"""

from __future__ import annotations

import random
import string


def words(seed: int | str, num_tokens: int) -> str:
    rng = random.Random(str(seed))
    letters = string.ascii_lowercase
    return "".join(
        " " + "".join(rng.choices(letters, k=rng.randint(1, 7))) for _ in range(num_tokens)
    )
