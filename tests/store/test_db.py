"""Database URLs: the async driver is added, other databases are refused, and where the URL comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tokenfleet.commands.database import resolve_database_url
from tokenfleet.store.db import async_url


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sqlite:///tenants.db", "sqlite+aiosqlite:///tenants.db"),
        ("sqlite:////var/lib/tf.db", "sqlite+aiosqlite:////var/lib/tf.db"),
        ("sqlite:///:memory:", "sqlite+aiosqlite:///:memory:"),
        ("sqlite://", "sqlite+aiosqlite://"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("postgresql://postgres@db.internal/tokenfleet", "postgresql+asyncpg://postgres@db.internal/tokenfleet"),
        ("postgres://u:secret@h:5433/d", "postgresql+asyncpg://u:secret@h:5433/d"),
        ("postgresql+asyncpg://h/d", "postgresql+asyncpg://h/d"),
    ],
)
def test_async_driver_is_added(given, expected):
    assert async_url(given) == make_url(expected)


def test_home_is_expanded_in_sqlite_paths():
    assert async_url("sqlite:///~/x.db").database == str(Path.home() / "x.db")


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("mysql://h/d", "unsupported database 'mysql'"),
        ("postgresql+psycopg2://h/d", "use 'postgresql+asyncpg'"),
        ("sqlite+pysqlite:///x.db", "use 'sqlite+aiosqlite'"),
        ("not a url", "not a database URL"),
    ],
)
def test_unusable_urls_are_named(given, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        async_url(given)


def test_password_is_not_shown_in_errors():
    with pytest.raises(ValueError) as caught:
        async_url("mysql://u:hunter2@h/d")
    assert "hunter2" not in str(caught.value)


def test_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TOKENFLEET_DATABASE_URL", raising=False)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("model_name: m\nmodel_path: /x\ndatabase_url: postgresql://from-config/db\n")
    default = resolve_database_url(None, None)  # the default `tokenfleet serve` instance's (port 8000)
    assert default == f"sqlite:///{tmp_path}/.local/share/tokenfleet/serve-8000/tokenfleet.db"
    assert resolve_database_url(None, str(fleet)) == "postgresql://from-config/db"
    monkeypatch.setenv("TOKENFLEET_DATABASE_URL", "sqlite:///from-env.db")
    assert resolve_database_url(None, str(fleet)) == "sqlite:///from-env.db"
    assert resolve_database_url("sqlite:///flag.db", str(fleet)) == "sqlite:///flag.db"
    monkeypatch.delenv("TOKENFLEET_DATABASE_URL")
    fleet.write_text("model_name: m\nmodel_path: /x\n")  # no database_url: the embedded default
    assert resolve_database_url(None, str(fleet)) == default
