"""Tokenizers for the precise-mode tests: the simulated engine's model files, edited."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from cachemap.tokenizer import ModelTokenizer
from loadgen.engine.tokenizer import MODEL_DIR


def edited_tokenizer(directory: Path, edit: Callable[[dict[str, Any]], None]) -> ModelTokenizer:
    """The engine's tokenizer with `edit` applied to its `tokenizer.json`, written to
    `directory` beside the engine's `tokenizer_config.json`."""
    spec = orjson.loads((MODEL_DIR / "tokenizer.json").read_bytes())
    edit(spec)
    (directory / "tokenizer.json").write_bytes(orjson.dumps(spec))
    (directory / "tokenizer_config.json").write_bytes(
        (MODEL_DIR / "tokenizer_config.json").read_bytes()
    )
    return ModelTokenizer(directory)


def merging_tokenizer(directory: Path) -> ModelTokenizer:
    """The engine's tokenizer without its pre-tokenizer: its BPE then merges across spaces, so
    a text cut at word boundaries no longer encodes as it does whole (what the probes and the
    sampled checks must catch)."""
    return edited_tokenizer(directory, lambda spec: spec.update(pre_tokenizer=None))
