"""The engine's tokenizer is reproducible: a fresh `python -m tools.build_tokenizer` gives the
committed loadgen/engine/model/ files (the drift check), and the corpus is deterministic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tools.build_tokenizer import MODEL_DIR, build, corpus, drift, tokenization_of


def test_a_fresh_build_is_the_committed_model_directory() -> None:
    built = build()
    assert sorted(built) == ["tokenizer.json", "tokenizer_config.json"]
    assert drift(built) == [], "run `make tokenizer` and commit loadgen/engine/model/"
    config = json.loads(built["tokenizer_config.json"])
    assert config["chat_template"] == (MODEL_DIR / "chat_template.jinja").read_text()
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    decoder = config["added_tokens_decoder"]
    assert decoder["4090"]["content"] == "<|im_start|>" and decoder["4090"]["special"]
    assert decoder["4092"]["content"] == "<tool_call>" and not decoder["4092"]["special"]


def test_the_corpus_is_the_same_on_every_run() -> None:
    first = list(itertools.islice(corpus(), 3000))
    assert first == list(itertools.islice(corpus(), 3000))
    assert first != list(itertools.islice(corpus(seed=1), 3000))


def test_drift_is_what_tokenizes_differently(tmp_path: Path) -> None:
    committed = {
        n: (MODEL_DIR / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json")
    }
    for name, text in committed.items():
        (tmp_path / name).write_text(text)
    # the same tokenization serialized another way (merges as pairs, compact) is no drift
    data = json.loads(committed["tokenizer.json"])
    data["model"]["merges"] = [
        m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert drift(committed, tmp_path) == []
    # one merge less is
    data["model"]["merges"] = data["model"]["merges"][:-1]
    assert tokenization_of(json.dumps(data)) != tokenization_of(committed["tokenizer.json"])
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert drift(committed, tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
