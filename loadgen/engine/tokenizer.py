"""The simulated engine's tokenizer: deterministic, documented, and cheap.

Tokenizer "kvgate-sim-v1":
- A token is one match of `TOKEN_PATTERN` over the text: an optional single space followed by
  1–8 non-whitespace characters, or one whitespace character on its own. So "Hello world" is
  ["Hello", " world"], a random-letter prompt "a B c" is one token per letter, and a word longer
  than 8 characters is split every 8.
- Token ids are 31-bit MurmurHash3 values of the token text modulo `VOCAB_SIZE` (ids only leave
  the engine through /tokenize and the render endpoints; the prefix cache hashes the text, so
  two different texts never share a block).
- Chat requests are rendered with kvgate's canonical rendering (`cachemap.rendering`) as the
  chat template, so the gateway's byte blocks and these token blocks describe the same text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import mmh3

TOKEN_PATTERN = re.compile(r" ?[^\s]{1,8}|\s")
VOCAB_SIZE = 151_936
"""Qwen2's vocabulary size: ids look like a real model's."""

_LEXICON_TEXT = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "but which one all were can there been has their more if will would about so what "
    "when up out into them some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three "
)
_LEXICON = tuple(_LEXICON_TEXT.split())

_ID_CACHE: dict[str, int] = {}
_ID_CACHE_LIMIT = 1 << 18


def tokenize(text: str) -> list[str]:
    return TOKEN_PATTERN.findall(text)


def count_tokens(text: str) -> int:
    return sum(1 for _ in TOKEN_PATTERN.finditer(text))


def token_id(token: str) -> int:
    tid = _ID_CACHE.get(token)
    if tid is None:
        tid = mmh3.hash(token, signed=False) % VOCAB_SIZE
        if len(_ID_CACHE) < _ID_CACHE_LIMIT:
            _ID_CACHE[token] = tid
    return tid


def token_ids(tokens: Sequence[str]) -> list[int]:
    """`token_id` of each token, without the per-token cache: synthetic prompts are mostly
    distinct words, and a straight mmh3 pass is ~10x faster than a missing cache lookup."""
    hash_ = mmh3.hash
    return [hash_(t, signed=False) % VOCAB_SIZE for t in tokens]


def output_tokens(seed: int, count: int) -> list[str]:
    """`count` deterministic output tokens (" word" each, one token apiece) for a prompt seed."""
    n = len(_LEXICON)
    return [" " + _LEXICON[(seed + 7919 * k) % n] for k in range(count)]


def block_hashes(
    tokens: Sequence[str] | Sequence[int],
    block_size: int,
    cache_salt: str | None,
    *,
    resume: Sequence[bytes] = (),
) -> list[bytes]:
    """vLLM-style chained hashes of the full token blocks; `cache_salt` is mixed into block 0.

    `resume`: hashes already computed for the leading blocks of `tokens` (they are kept and the
    chain continues from the last one), so extending a prompt by its output costs only the tail.
    """
    parent = (
        resume[-1]
        if resume
        else mmh3.mmh3_x64_128_digest(b"salt\x00" + (cache_salt or "").encode())
    )
    digest = mmh3.mmh3_x64_128_digest
    out: list[bytes] = list(resume)
    for start in range(len(resume) * block_size, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        if block and isinstance(block[0], int):
            text = " ".join(map(str, block)).encode()
        else:
            text = "".join(block).encode()  # type: ignore[arg-type]
        parent = digest(parent + text)
        out.append(parent)
    return out
