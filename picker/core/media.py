"""Images, audio and video in a prompt: what each stands for in the prompt's text, so media take part in prefix keys
and in every token estimate as the model server will count them.

A media part of a chat message is rendered as a marker naming its kind, a content hash and its estimated tokens,
padded to that many tokens' worth of characters (`CHARS_PER_TOKEN`, 4, each): `<|image:3fa2c4...:391|>.....`. Equal
media at equal positions after equal text give equal blocks, so a request with an image already sent lands where
it was served; a different image breaks the chain at its first block, as it breaks the model server's. The hash is
of the decoded bytes for a data URL (two encodings of one file match; the model server hashes the bytes too), of
the URL for a remote one (the picker never fetches what a client names) and of the client's `uuid` when a part
carries one (vLLM then uses it as the item's identity). Before, a part rendered as its JSON: a 100 KB data URL
counted as 25,000 tokens in every estimate (P/D thresholds, in-flight work, predicted TTFT).

Token estimates per model (`multimodal:` section, with `models:` overrides): an image costs a fixed count
(`imageTokens`, LLaVA-1.5: 576) or what the model's processor makes of its size, read from the PNG, JPEG, GIF or
WebP header of a data URL. Two processor families are known, as their image layouts differ: `patches` (the default;
Qwen2-VL and its successors: rounded to `imagePatchPixels`-pixel squares, one token each, between `minImageTokens`
and `maxImageTokens`) and `tiles` (Idefics3 and SmolVLM: resized to `imageLongestEdge`, cut into
`imageTilePixels`-pixel tiles of `imageTileTokens` each, plus a downscaled whole image and the markers around
them). A model whose family is wrong is off by up to 7x (a 640 x 480 image is 391 tokens as patches, 2,227 as
Idefics3's tiles), so the family is per model. An image whose size cannot be read (a remote URL) costs
`unsizedImageTokens`, by default what the family counts for 640 x 480. Audio: `audioTokensPerSecond` of a WAV's
duration, up to `maxAudioSeconds` (Whisper-style encoders such as Qwen2-Audio's take one 30-second window and drop
the rest), else `unsizedAudioTokens`; video: `videoTokens`.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from xxhash import xxh3_64_hexdigest

from picker.core.schema import Section, decode


class MediaTokens(Section):
    """How many tokens a model counts for a media item (camelCase keys in YAML)."""

    image_tokens: int = Field(0, ge=0)  # a fixed count per image (LLaVA-1.5: 576); 0: from the image's size
    image_layout: Literal["patches", "tiles"] = "patches"  # the processor family (see the module docstring)
    image_patch_pixels: int = Field(28, gt=0)  # patches: side of the pixel square one token covers (14 x 2)
    min_image_tokens: int = Field(4, gt=0)
    max_image_tokens: int = Field(1280, gt=0)
    image_longest_edge: int = Field(1456, gt=0)  # tiles: the longest side after resizing (Idefics3: 4 x 364)
    image_tile_pixels: int = Field(364, gt=0)  # tiles: a tile's side (Idefics3: 364; SmolVLM: 512)
    image_tile_tokens: int = Field(169, gt=0)  # tiles: tokens a tile stands for (Idefics3: 169; SmolVLM: 64)
    unsized_image_tokens: int = Field(0, ge=0)  # size unknown (a remote URL); 0: the family's count for 640 x 480
    audio_tokens_per_second: float = Field(25.0, gt=0)  # Whisper-style encoders (Qwen2-Audio): 25 per second
    max_audio_seconds: float = Field(30.0, ge=0)  # what the encoder takes of a clip (Qwen2-Audio: 30); 0: all
    unsized_audio_tokens: int = Field(750, gt=0)  # duration unknown (remote or compressed audio): 30 s
    video_tokens: int = Field(1024, gt=0)


class MultimodalConfig(MediaTokens):
    """The `multimodal:` config section: the defaults above, and per served model name its own."""

    models: dict[str, MediaTokens] = Field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MultimodalConfig:
        return decode(cls, data, "multimodal")

    def for_model(self, model: str) -> MediaTokens:
        return self.models.get(model, self)


DEFAULT_MEDIA = MultimodalConfig()
UNSIZED_IMAGE = (640, 480)  # what an image of unknown size is taken to be: a common camera and screenshot size


@dataclass(frozen=True, slots=True)
class MediaItem:
    kind: str  # image, audio or video
    digest: str  # 16 hex digits of the content hash
    tokens: int
    source: str  # "data" (bytes in the request), "url" (named by the client), "uuid" (the client's identity)


def marker(item: MediaItem, chars_per_token: int) -> str:
    """What `item` stands as in the prompt's text (see the module docstring)."""
    text = f"<|{item.kind}:{item.digest}:{item.tokens}|>"
    return text + "." * max(0, item.tokens * chars_per_token - len(text))


def media_of(part: Mapping[str, Any], tokens: MediaTokens) -> MediaItem | None:
    """The media item a content part is, else None. ValueError with the reason for a media part that cannot be
    read (an invalid data URL): the client's 400."""
    kind, url, inline = _reference(part)
    if kind is None:
        return None
    if inline is not None:  # base64 data of input_audio / an Anthropic base64 source
        payload: bytes | None = _base64(inline)
    elif url.startswith("data:"):
        payload = _data_url_bytes(url)
    else:
        payload = None
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        digest, source = _digest(b"uuid:" + uuid.encode()), "uuid"
    elif payload is not None:
        digest, source = _digest(payload), "data"
    else:
        digest, source = _digest(b"url:" + url.encode()), "url"
    return MediaItem(kind, digest, _tokens(kind, payload, tokens), source)


def _reference(part: Mapping[str, Any]) -> tuple[str | None, str, str | None]:
    """(kind, its URL, its inline base64 data) of a media part in the OpenAI, vLLM, Responses or Anthropic shape;
    kind None for another part."""
    kind = part.get("type")
    if kind in ("image_url", "video_url", "audio_url"):
        value = part.get(kind)
        url = value.get("url") if isinstance(value, Mapping) else value
        return kind.removesuffix("_url"), url if isinstance(url, str) else "", None
    if kind == "input_image":
        url = part.get("image_url") or part.get("file_id") or ""
        return "image", str(url.get("url", "") if isinstance(url, Mapping) else url), None
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, Mapping) else None
        return "audio", "", data if isinstance(data, str) else None
    if kind == "image" and isinstance(part.get("source"), Mapping):  # Anthropic's Messages API
        source = part["source"]
        data = source.get("data") if source.get("type") == "base64" else None
        return "image", str(source.get("url", "")), data if isinstance(data, str) else None
    return None, "", None


def _digest(data: bytes) -> str:
    return xxh3_64_hexdigest(data)  # a wrong match only misroutes: speed over collision resistance (~10 GB/s)


def _data_url_bytes(url: str) -> bytes:
    header, sep, data = url.partition(",")
    if not sep:
        raise ValueError("a data URL needs a ',' before its data")
    return _base64(data) if header.endswith(";base64") else data.encode()


def _base64(data: str) -> bytes:
    """Standard or URL-safe base64, line breaks and missing padding forgiven (what clients send and servers
    accept); ValueError for anything else."""
    try:
        return base64.b64decode(data, validate=True)  # the common case, at C speed
    except (binascii.Error, ValueError):
        pass
    compact = re.sub(r"\s+", "", data).translate(_URLSAFE)
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("media data is not valid base64") from None


_URLSAFE = str.maketrans("-_", "+/")


def _tokens(kind: str, payload: bytes | None, tokens: MediaTokens) -> int:
    if kind == "image":
        if tokens.image_tokens:
            return tokens.image_tokens
        size = image_size(payload) if payload else None
        if size and min(size) > 0:
            return image_tokens(*size, tokens)
        return tokens.unsized_image_tokens or image_tokens(*UNSIZED_IMAGE, tokens)
    if kind == "audio":
        seconds = wav_seconds(payload) if payload else None
        if not seconds:
            return tokens.unsized_audio_tokens
        if tokens.max_audio_seconds:
            seconds = min(seconds, tokens.max_audio_seconds)
        return max(1, int(seconds * tokens.audio_tokens_per_second))  # the encoder's frames, rounded down
    return tokens.video_tokens


def image_tokens(width: int, height: int, tokens: MediaTokens) -> int:
    """What the model's processor family (`image_layout`) counts for an image of this size."""
    if tokens.image_layout == "tiles":
        return _tiled_image_tokens(width, height, tokens)
    return _patched_image_tokens(width, height, tokens)


def _tiled_image_tokens(width: int, height: int, tokens: MediaTokens) -> int:
    """Idefics3's arithmetic (transformers' Idefics3 processor): the longest side resized to `image_longest_edge`
    (the other truncated, then made even), tiles of `image_tile_pixels` covering it, each tile its tokens and two
    markers (around it, its row and column), a line break per row, then the whole image downscaled to one tile with
    three markers. One image that fits a tile is that last part alone."""
    edge, tile, per_tile = tokens.image_longest_edge, tokens.image_tile_pixels, tokens.image_tile_tokens
    aspect = width / height
    if width >= height:
        width, height = edge, int(edge / aspect)
        height += height % 2
    else:
        width, height = int(edge * aspect), edge
        width += width % 2
    whole = per_tile + 3
    if max(width, height) <= tile:
        return whole
    rows, cols = math.ceil(max(height, 1) / tile), math.ceil(max(width, 1) / tile)
    return rows * (cols * (per_tile + 2) + 1) + whole


def _patched_image_tokens(width: int, height: int, tokens: MediaTokens) -> int:
    """Qwen2-VL's arithmetic (transformers' smart_resize): each side rounded to the patch square, the area kept
    between the min and max token counts' pixels, one token per square."""
    side = tokens.image_patch_pixels
    area = side * side
    low, high = tokens.min_image_tokens * area, tokens.max_image_tokens * area
    h, w = max(side, round(height / side) * side), max(side, round(width / side) * side)
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h, w = max(side, math.floor(height / beta / side) * side), max(side, math.floor(width / beta / side) * side)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = math.ceil(height * beta / side) * side, math.ceil(width * beta / side) * side
    return h * w // area


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, GIF, JPEG or WebP header; None for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return width, height
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_size(data)
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return width, height
        i += 2 + length
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8 " and len(data) >= 30:
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


def wav_seconds(data: bytes) -> float | None:
    """A WAV's duration from its header (the data chunk's size over the byte rate); None for other formats."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    i, byte_rate = 12, 0
    while i + 8 <= len(data):
        name, size = data[i:i + 4], struct.unpack("<I", data[i + 4:i + 8])[0]
        if name == b"fmt " and i + 20 <= len(data):
            byte_rate = struct.unpack("<I", data[i + 16:i + 20])[0]
        elif name == b"data":
            return min(size, len(data) - i - 8) / byte_rate if byte_rate else None
        i += 8 + size + (size & 1)
    return None
