"""The README's screenshots of the pages (docs/screenshots, taken by `python -m tests.web.screenshots`): shown in the
README, whole PNGs (every chunk's CRC, the image data inflating to its declared size), a screen's size, not
blank, and not older than the last change to the pages by more than STALE_AFTER."""

from __future__ import annotations

import struct
import subprocess
import zlib
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "screenshots"
PAGES = ROOT / "tokenfleet" / "web" / "static"
STALE_AFTER = timedelta(days=60)
SIGNATURE = b"\x89PNG\r\n\x1a\n"
BYTES_PER_PIXEL = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> bytes per pixel at 8 bits per sample


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, the filtered scanlines), checking the file's structure as a decoder would."""
    assert data[:8] == SIGNATURE, "not a PNG"
    position, chunks = 8, []
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind, body = data[position + 4 : position + 8], data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in a {kind!r} chunk"
        chunks.append((kind, body))
        position += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert depth == 8 and colour in BYTES_PER_PIXEL and interlace == 0, (depth, colour, interlace)
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(pixels) == height * (1 + width * BYTES_PER_PIXEL[colour])
    return width, height, pixels


def last_change(path: Path) -> int:
    """When git last committed `path` (Unix time), or its file time when git has no commit of it."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct", "--", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return int(out) if out else int(path.stat().st_mtime)


@pytest.mark.parametrize("name", ["chat.png", "console.png"])
def test_the_screenshots_are_shown_whole_and_current(name):
    shot = SHOTS / name
    assert shot.is_file(), f"missing {shot}: run python -m tests.web.screenshots"
    assert f"docs/screenshots/{name}" in (ROOT / "README.md").read_text()
    width, height, pixels = decode_png(shot.read_bytes())
    assert 1000 <= width <= 2600 and 600 <= height <= 3000, (width, height)
    assert len(set(pixels)) > 20, "the screenshot is blank"
    page = {"chat.png": "chat.html", "console.png": "console.html"}[name]
    newest_page = max(last_change(PAGES / page), last_change(PAGES / "style.css"))
    age = timedelta(seconds=newest_page - last_change(shot))
    assert age <= STALE_AFTER, f"{name} is {age.days} days older than its page: run python -m tests.web.screenshots"
