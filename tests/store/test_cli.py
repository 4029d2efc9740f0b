"""`tokenfleet keys create | list | revoke` as a user runs them, against an SQLite file."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from tokenfleet.cli import main
from tokenfleet.store.db import Database
from tokenfleet.store.tenants import TenantStore


def keys(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet", "keys", *args], capture_output=True, text=True, env=env, timeout=60
    )


async def authenticate(url: str, plaintext: str):
    async with Database(url) as db:
        return await TenantStore(db).authenticate(plaintext)


def test_create_list_revoke(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("TOKENFLEET_DATABASE_URL", None)
    created = keys(
        "create",
        "--org",
        "acme",
        "--user",
        "alice",
        "--tier",
        "paid",
        "--name",
        "laptop",
        "--database-url",
        url,
        env=env,
    )
    assert created.returncode == 0, created.stderr
    lines = created.stdout.splitlines()
    plaintext = next(line for line in lines if line.startswith("tf-"))
    key_id = lines[0].split()[1]
    assert key_id.startswith("key_") and "will not be shown again" in lines[-1]
    principal = asyncio.run(authenticate(url, plaintext))
    assert principal.key_id == key_id and principal.tier == "paid" and principal.user_name == "alice"

    env["TOKENFLEET_DATABASE_URL"] = url  # the environment variable works as well as the flag
    listed = keys("list", "--org", "acme", env=env)
    assert listed.returncode == 0 and key_id in listed.stdout and plaintext[:8] in listed.stdout
    assert plaintext not in listed.stdout and "active" in listed.stdout

    revoked = keys("revoke", key_id, env=env)
    assert revoked.returncode == 0 and key_id in revoked.stdout
    assert asyncio.run(authenticate(url, plaintext)) is None
    assert not (tmp_path / ".local").exists()  # the default database was never touched


def test_refusals_exit_1_with_the_reason(tmp_path, capsys):
    """In this process (the same code path as the command, without paying another interpreter start)."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["keys", "revoke", "key_nope", "--database-url", url]) == 1
    assert "no API key with id 'key_nope'" in capsys.readouterr().err
    assert main(["keys", "create", "--org", "o", "--user", "u", "--tier", "gold", "--database-url", url]) == 1
    assert "unknown tier 'gold'" in capsys.readouterr().err
    assert main(["keys", "list", "--database-url", url]) == 0
    assert capsys.readouterr().out.strip() == "no API keys"
    assert main(["keys", "list", "--database-url", "mysql://h/d"]) == 1
    assert "unsupported database" in capsys.readouterr().err
