"""Chat prompts synthesized from a trace's hash ids, exact under the engine's tokenizer.

A request becomes one user message whose content is

    text(id_0) ‖ text(id_1) ‖ ... ‖ text(id_k)[:r words] ‖ tail(request)

where text(id) is `block_size` single-token words (`loadgen.engine.tokenizer`) drawn from a
generator seeded by the id alone, cut to make the count exact, and the tail is words seeded by
the request: the tokens past the last hash id of a trace that hashes full blocks only, which
no other request shares.

Invariants (tests/loadgen/test_traces.py):
- equal hash-id prefixes give byte-identical content prefixes (a block's text depends only on
  its id) and, since single-token words never merge, identical token prefixes: the engine's
  prefix cache sees exactly the sharing the trace describes (block-aligned to the trace's
  blocks after the template's fixed header);
- the rendered chat prompt (the engine's chat template, generation prompt included) is exactly
  `input_length` tokens, for every request of more than `chat_overhead_tokens` tokens;
- the same trace gives the same bytes in every process (no Python hash randomisation).
"""

from __future__ import annotations

import array
import functools
import itertools
import random
from collections.abc import Iterator, Sequence

from loadgen.engine.tokenizer import default_tokenizer
from loadgen.traces.readers import MOONCAKE_BLOCK_SIZE, TraceRequest

_TEXT_CACHE_BLOCKS = 16_384
"""Synthesized block texts kept (~3 KB each for 512-token blocks: ~50 MB at most), shared by
every synthesizer of the process: a bench's arms and replays draw the same blocks again."""


def _draw(words: Sequence[str], seed: str, n: int) -> list[str]:
    raw = random.Random(seed).randbytes(2 * n)
    num_words = len(words)
    return [words[i % num_words] for i in array.array("H", raw)]


@functools.lru_cache(maxsize=_TEXT_CACHE_BLOCKS)
def _block_text(namespace: str, block_size: int, hash_id: int) -> tuple[str, list[int]]:
    """A block's text and its words' end offsets: a function of its id, namespace and size."""
    words = _draw(default_tokenizer().words, f"{namespace}/block/{hash_id}", block_size)
    return "".join(words), list(itertools.accumulate(len(w) for w in words))


class PromptSynthesizer:
    """Deterministic chat prompts from hash ids (see the module docstring for the invariants)."""

    def __init__(self, block_size: int = MOONCAKE_BLOCK_SIZE, namespace: str = "kvgate") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.namespace = namespace
        self._words = default_tokenizer().words
        tokenizer = default_tokenizer()
        one_word = tokenizer.render_chat([self._message(self._words[0])])
        self.chat_overhead_tokens = tokenizer.count(one_word) - 1
        """Tokens of the template around the content (header and generation prompt)."""

    @staticmethod
    def _message(content: str) -> dict[str, str]:
        return {"role": "user", "content": content}

    def _draw(self, seed: str, n: int) -> list[str]:
        return _draw(self._words, seed, n)

    def block_text(self, hash_id: int) -> tuple[str, list[int]]:
        """The block's full text and the end offset (in characters) of each of its words
        (shared: not to be changed)."""
        return _block_text(self.namespace, self.block_size, hash_id)

    def content(self, hash_ids: Sequence[int], num_tokens: int, tail_key: str = "") -> str:
        """The first `num_tokens` tokens of the blocks named by `hash_ids`, then (when the ids
        run out first) words of the request's own, seeded by `tail_key`."""
        pieces: list[str] = []
        left = num_tokens
        for h in hash_ids:
            if left <= 0:
                break
            text, offsets = self.block_text(h)
            take = min(left, self.block_size)
            pieces.append(text if take == self.block_size else text[: offsets[take - 1]])
            left -= take
        if left > 0:
            pieces.extend(self._draw(f"{self.namespace}/tail/{tail_key}", left))
        return "".join(pieces)

    def messages(self, req: TraceRequest) -> list[dict[str, str]]:
        """One user message whose rendered chat prompt is `input_length` tokens."""
        body = max(req.input_length - self.chat_overhead_tokens, 1)
        tail_key = f"{req.index}/{req.arrival_s!r}/{req.hash_ids[-1] if req.hash_ids else ''}"
        return [self._message(self.content(req.hash_ids, body, tail_key))]

    def iter_bodies(
        self, requests: Sequence[TraceRequest], model: str
    ) -> Iterator[dict[str, object]]:
        for req in requests:
            yield {"model": model, "messages": self.messages(req), "max_tokens": req.output_length}
