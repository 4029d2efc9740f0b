"""Which database a command uses."""

from __future__ import annotations

import os

from tokenfleet.config import FleetConfig
from tokenfleet.store.db import ENV_VAR, default_database_url


def resolve_database_url(flag: str | None = None, config_path: str | None = None) -> str:
    """The --database-url flag, else $TOKENFLEET_DATABASE_URL, else `database_url` in the fleet file, else the
    embedded SQLite file."""
    if flag:
        return flag
    if config_path and not os.environ.get(ENV_VAR):
        url = FleetConfig.load(config_path).database_url
        if url:
            return url
    return default_database_url()
