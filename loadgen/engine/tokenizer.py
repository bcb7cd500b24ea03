"""The simulated engine's tokenizer: a byte-level BPE and a ChatML chat template, loaded from a
Hugging Face model directory, so the engine tokenizes the way a vLLM replica of a real model
does (and a gateway can load the same files as "the model's tokenizer").

The model directory `MODEL_DIR` (`loadgen/engine/model/`, built reproducibly by
`python -m tools.build_tokenizer`, see docs/engine.md) holds `tokenizer.json` (4,089 BPE tokens
then 8 added ones: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<tool_call>`, `</tool_call>`,
`<tool_response>`, `</tool_response>`, `<|image_pad|>` (the image placeholder,
`cachemap.multimodal`)) and `tokenizer_config.json` (special tokens, `image_token` and the chat
template, `chat_template.jinja`).

Invariants the load generators build on (tests/loadgen/test_tokenizer.py checks them):
- Round trip: `decode(encode(text)) == text` for any text (byte-level BPE: every byte has a
  token; added tokens are matched in the text, as vLLM's `add_special_tokens=False` chat
  tokenization does).
- Single-token words (`words`): every vocabulary entry that is a space and two or more
  lowercase letters and encodes back to itself alone. The pre-tokenizer (GPT-2's byte-level
  split) starts a new piece at each such leading space and merges never cross pieces, so a
  concatenation of n words is exactly n tokens, the concatenation of their ids, wherever it
  stands (after a newline, a colon, a special token), as long as no letter follows it directly.
- Output tokens (`output_ids`) are ids of single-token words chosen from a seed: decoding them
  one by one gives the same text as decoding them together, so streamed deltas add up.
"""

from __future__ import annotations

import array
import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import mmh3

from cachemap.tokenizer import ModelTokenizer

MODEL_DIR = Path(__file__).resolve().parent / "model"
"""The engine's Hugging Face tokenizer directory (shipped as package data): what `/server_info`
reports as `tokenizer_path`, and what a gateway loads to tokenize as the engine does."""
TOKENIZER_NAME = "kvgate-sim-bpe-4k"

_WORD = re.compile(r"Ġ[a-z]{2,}")
"""A vocabulary entry that is a space (Ġ in the byte-level alphabet) and lowercase letters."""


class EngineTokenizer(ModelTokenizer):
    """The model directory's tokenizer (`cachemap.tokenizer`) with what load generation needs:
    the single-token words and the output tokens."""

    def __init__(self, model_dir: Path = MODEL_DIR) -> None:
        super().__init__(model_dir)
        self.words, self.word_ids = self._single_token_words()

    def _single_token_words(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        found: list[tuple[int, str]] = []
        for token, token_id in self._tokenizer.get_vocab(with_added_tokens=False).items():
            if _WORD.fullmatch(token):
                text = " " + token[1:]
                if self.encode(text) == [token_id]:
                    found.append((token_id, text))
        found.sort()
        return tuple(w for _, w in found), tuple(i for i, _ in found)

    def output_ids(self, seed: int, count: int) -> list[int]:
        """`count` deterministic output tokens for a prompt seed (single-token words)."""
        ids, n = self.word_ids, len(self.word_ids)
        return [ids[(seed + 7919 * k) % n] for k in range(count)]

    @functools.cached_property
    def _pieces(self) -> dict[int, str]:
        return {i: w for i, w in zip(self.word_ids, self.words, strict=True)}

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The text of each token of `ids` on its own (the streamed deltas)."""
        known = self._pieces
        return [known.get(i) or self.decode([i]) for i in ids]


@functools.cache
def default_tokenizer() -> EngineTokenizer:
    """The engine's tokenizer (`MODEL_DIR`), loaded once per process."""
    return EngineTokenizer()


def count_tokens(text: str) -> int:
    """Tokens of `text` under the engine's tokenizer (what `billing_tokenizer` can name as
    `loadgen.engine.tokenizer:count_tokens`)."""
    return default_tokenizer().count(text)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    *,
    resume: Sequence[bytes] = (),
    lora_name: str | None = None,
    extras: Mapping[int, bytes] | None = None,
) -> list[bytes]:
    """vLLM-style chained hashes of the full token blocks; `cache_salt` is mixed into block 0.

    hash(-1) = H("salt" ‖ 0x00 ‖ cache_salt [‖ 0x00 "lora" 0x00 ‖ lora_name]), hash(i) =
    H(hash(i-1) ‖ ids of block i as 32-bit little-endian), H = MurmurHash3 x64 128. A LoRA
    adapter's chain so shares no block with the base model's, as in vLLM (which mixes the
    adapter's name into every block's extra keys; rooting the chain in it is equivalent here).
    `resume`: hashes already computed for the leading blocks (they are kept and the chain
    continues from the last one), so extending a prompt by its output costs only the tail.
    `extras`: block index -> bytes hashed after its ids (the images whose placeholders the
    block holds, `cachemap.multimodal.extras_of`: vLLM's multimodal extra keys).
    """
    root = b"salt\x00" + (cache_salt or "").encode()
    if lora_name is not None:
        root += b"\x00lora\x00" + lora_name.encode()
    parent = resume[-1] if resume else mmh3.mmh3_x64_128_digest(root)
    digest = mmh3.mmh3_x64_128_digest
    out: list[bytes] = list(resume)
    ids = array.array("I", token_ids).tobytes()
    width = 4 * block_size
    extra = extras or {}
    for start in range(len(resume) * width, len(ids) - width + 1, width):
        parent = digest(parent + ids[start : start + width] + extra.get(start // width, b""))
        out.append(parent)
    return out
