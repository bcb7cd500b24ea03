"""docs/configuration.md lists every setting: its generated index is in sync with the settings,
and every setting also has a row (or a mention) in the hand-written tables above it."""

from __future__ import annotations

import re

from gateway.settings import Settings
from tools import settings_doc


def test_the_generated_index_is_in_sync() -> None:
    assert settings_doc.main(["--check"]) == 0


def test_every_setting_is_explained_above_the_index() -> None:
    text = settings_doc.DOC.read_text().split(settings_doc.BEGIN)[0]
    explained = set(re.findall(r"`([a-z][a-z0-9_]*)`", text))
    missing = [name for name in Settings.model_fields if name not in explained]
    assert not missing, f"settings with no words in docs/configuration.md: {missing}"


def test_the_check_fails_on_a_missing_setting() -> None:
    text = settings_doc.DOC.read_text()
    dropped = re.sub(r"\| `log_format` \| `KVGATE_LOG_FORMAT`.*\n", "", text)
    assert dropped != text and settings_doc.rendered(dropped) != dropped
