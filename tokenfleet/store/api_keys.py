"""API key material: the plaintext format, the id shown in listings, and the hash that is all the store keeps."""

from __future__ import annotations

import hashlib
import re
import secrets

KEY_PREFIX = "tf-"
SHOWN_CHARS = 8  # how much of a key listings show, enough to tell keys apart
_KEY_RE = re.compile(r"tf-[A-Za-z0-9_-]{43}")  # token_urlsafe(32) is always 43 characters


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(plaintext: str) -> str:
    """SHA-256 hex. No salt or slow hash is needed: keys are 256-bit random secrets, not guessable passwords."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def shown_prefix(plaintext: str) -> str:
    return plaintext[:SHOWN_CHARS]


def well_formed(plaintext: object) -> bool:
    return isinstance(plaintext, str) and _KEY_RE.fullmatch(plaintext) is not None


def new_id(kind: str) -> str:
    """Short record ids such as org_3f9a1c0b2d4e6f70."""
    return f"{kind}_{secrets.token_hex(8)}"
