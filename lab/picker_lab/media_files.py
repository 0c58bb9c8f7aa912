"""Small, valid media files made on the spot, for the tests and the media benchmarks: a PNG of any size that stays
small on the wire, a WAV of any length, and the data URL a client would send them in."""

from __future__ import annotations

import base64
import math
import struct
import zlib
from array import array


def png(width: int, height: int, shade: int = 0) -> bytes:
    """An 8-bit greyscale PNG of one row repeated (compresses to almost nothing); `shade` makes images differ."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = (b"\x00" + bytes([shade]) * width) * height
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def wav(seconds: float, rate: int = 16000, tone: bool = False) -> bytes:
    """A mono 16-bit WAV, `seconds` long: silence, or with `tone` a sine (what a model server would rather hear)."""
    count = int(seconds * rate)
    samples = array("h", (int(3000 * math.sin(i / 20)) for i in range(count))).tobytes() if tone \
        else b"\x00\x00" * count
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", len(samples)) + samples)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
