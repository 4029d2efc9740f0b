"""`conversations:` in fleet.yaml: read like every other section, bad values are start-up errors naming it."""

from __future__ import annotations

import pytest
import yaml

from tokenfleet.config import FleetConfig


def load(tmp_path, section: dict) -> FleetConfig:
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"conversations": section}))
    return FleetConfig.load(tmp_path / "fleet.yaml")


def test_the_section_is_read(tmp_path):
    settings = load(tmp_path, {"save_interval_s": 0.5, "max_message_chars": 100, "default_model": "m"}).conversations
    assert (settings.save_interval_s, settings.max_message_chars, settings.default_model) == (0.5, 100, "m")
    assert FleetConfig().conversations.save_interval_s == 1.0


@pytest.mark.parametrize(
    "section, words",
    [
        ({"save_every": 1}, "unknown setting(s) save_every"),
        ({"save_interval_s": 0}, "save_interval_s must be positive"),
        ({"save_interval_s": 2, "stale_after_s": 5}, "at least three save intervals"),
        ({"max_message_chars": 0}, "at least 1"),
    ],
)
def test_bad_settings_are_clear_start_up_errors(tmp_path, section, words):
    with pytest.raises(ValueError) as e:
        load(tmp_path, section)
    assert "conversations" in str(e.value) and words in str(e.value)


def test_the_shipped_example_documents_the_section():
    from tests.gateway.test_config import EXAMPLE

    settings = FleetConfig.load(EXAMPLE).conversations
    assert (settings.save_interval_s, settings.stale_after_s, settings.max_tokens) == (1.0, 30, 1024)
    assert "conversations:" in EXAMPLE.read_text() and "stale_after_s" in EXAMPLE.read_text()
