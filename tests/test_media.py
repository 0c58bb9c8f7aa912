"""Images, audio and video in prompts (picker/core/media.py): a content hash and a token estimate in the prompt's
text instead of the part's JSON."""

from __future__ import annotations

import base64
import json
import random
import struct
from collections.abc import Mapping

import pytest

from picker.core.media import (
    DEFAULT_MEDIA,
    MediaTokens,
    MultimodalConfig,
    image_size,
    image_tokens,
    wav_seconds,
)
from picker.core.requests import ApiKind, InferenceRequest, RequestError, build_request, estimated_tokens
from picker.core.schema import ConfigError
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint
from picker.routing.director import Director
from picker.scheduling.config import build_scheduler
from picker_lab.media_files import data_url, png, wav


def chat(*parts: Mapping[str, object], model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": list(parts)}]}).encode()


def parse(body: bytes, media: MultimodalConfig = DEFAULT_MEDIA) -> InferenceRequest:
    return build_request({":path": "/v1/chat/completions", ":method": "POST"}, body, request_id="r", media=media)


def image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is in this picture?"}


def test_equal_images_match_and_different_ones_do_not() -> None:
    one, same, other = (parse(chat(TEXT, image(data_url(png(640, 480, s))))) for s in (0, 0, 9))
    assert one.prompt_text == same.prompt_text != other.prompt_text
    assert [i.tokens for i in one.media] == [391]  # Qwen2-VL: 644 x 476 -> 23 x 17


def test_the_hash_is_of_the_bytes_not_of_their_encoding() -> None:
    raw = png(64, 64)
    wrapped = base64.encodebytes(raw).decode()  # line breaks every 76 characters, as some clients send
    assert parse(chat(image(data_url(raw)))).prompt_text == \
        parse(chat(image(f"data:image/png;base64,{wrapped}"))).prompt_text


def test_a_100_kb_image_counts_as_its_tokens_not_as_its_characters() -> None:
    request = parse(chat(TEXT, image(data_url(png(1024, 1024) + b"\x00" * 100_000))))
    tokens = estimated_tokens(request, 4)
    assert 1225 <= tokens <= 1260  # 1,225 tokens (35 x 35 squares, scaled to max_pixels) and the text; its JSON ~34,000


def test_a_remote_image_is_hashed_by_its_url_and_never_fetched() -> None:
    a, b = (parse(chat(image(f"https://images.example/{n}.png"))) for n in ("cat", "dog"))
    assert a.prompt_text != b.prompt_text
    assert a.media[0].tokens == 391  # size unknown: unsizedImageTokens


def test_a_client_uuid_is_the_items_identity() -> None:
    a = parse(chat({**image(data_url(png(8, 8, 1))), "uuid": "img-1"}))
    b = parse(chat({**image("https://elsewhere.example/x.png"), "uuid": "img-1"}))
    assert a.media[0].digest == b.media[0].digest


def test_per_model_counts_and_fixed_counts() -> None:
    config = MultimodalConfig.from_dict({"models": {"llava": {"imageTokens": 576}}})
    assert parse(chat(image(data_url(png(64, 64))), model="llava"), config).media[0].tokens == 576
    assert parse(chat(image(data_url(png(64, 64))), model="qwen"), config).media[0].tokens == 4  # 2 x 2 squares
    with pytest.raises(ConfigError, match="multimodal.models.llava.imageTokns"):
        MultimodalConfig.from_dict({"models": {"llava": {"imageTokns": 576}}})


def test_qwen2_vl_arithmetic() -> None:
    tokens = MediaTokens()
    assert image_tokens(640, 480, tokens) == 391
    assert image_tokens(28, 28, tokens) == 4  # raised to min_pixels
    assert image_tokens(4000, 3000, tokens) <= 1280  # scaled down to max_pixels


def test_idefics3_tiles_arithmetic() -> None:
    """The counts vLLM 0.32 gave a locally built Idefics3 (`make media-real`) for these sizes, less the one token its
    tiny tokenizer spends on a second line break that real Idefics3 and SmolVLM tokenizers merge."""
    tiles = MediaTokens(image_layout="tiles")
    assert image_tokens(640, 480, tiles) == 2227  # 1456 x 1092: 4 x 3 tiles of 169 + the whole image's 169
    assert image_tokens(1024, 1024, tiles) == 2912  # upscaled to 1456 x 1456: 4 x 4 tiles
    assert image_tokens(3000, 200, tiles) == 857  # 1456 x 98 (97 made even): one row of four
    assert image_tokens(64, 64, MediaTokens(image_layout="tiles", image_longest_edge=364)) == 172  # one tile: whole
    smolvlm = MediaTokens(image_layout="tiles", image_longest_edge=2048, image_tile_pixels=512, image_tile_tokens=64)
    assert image_tokens(2048, 1024, smolvlm) == 2 * (4 * 66 + 1) + 67
    config = MultimodalConfig.from_dict({"models": {"smolvlm": {"imageLayout": "tiles"}}})
    assert config.for_model("smolvlm").image_layout == "tiles"
    remote = image("https://images.example/cat.png")
    assert parse(chat(remote, model="smolvlm"), config).media[0].tokens == 2227  # taken as 640 x 480
    assert parse(chat(remote, model="other"), config).media[0].tokens == 391
    with pytest.raises(ConfigError, match="multimodal.imageLayout"):
        MultimodalConfig.from_dict({"imageLayout": "mosaic"})


def test_an_image_of_no_pixels_costs_the_unsized_count() -> None:
    """A header claiming a zero side is read as no size: as patches it was counted as a strip one square high, and
    the tiles' arithmetic divides by it."""
    flat = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 640, 0) + b"\x00" * 9
    assert parse(chat(image(data_url(flat)))).media[0].tokens == 391


def test_audio_counts_its_seconds_and_other_formats_a_default() -> None:
    assert wav_seconds(wav(2.0)) == pytest.approx(2.0)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(2.0)).decode(), "format": "wav"}}
    assert parse(chat(part)).media[0].tokens == 50
    mp3 = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"ID3" + b"\x00" * 64).decode(),
                                                  "format": "mp3"}}
    assert parse(chat(mp3)).media[0].tokens == 750


def test_audio_counts_as_a_real_vllm_counts_it() -> None:
    """Qwen2-Audio on vLLM 0.32 (`make media-real`): 25 tokens a second rounded down, the first 30 seconds only."""
    def tokens(seconds: float, media: MultimodalConfig = DEFAULT_MEDIA) -> int:
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(seconds)).decode()}}
        return parse(chat(part), media).media[0].tokens

    assert [tokens(s) for s in (0.3, 2.5, 29.0, 45.0, 60.0)] == [7, 62, 725, 750, 750]
    assert tokens(60.0, MultimodalConfig.from_dict({"maxAudioSeconds": 0})) == 1500  # an encoder that takes it all


def test_headers_of_other_formats() -> None:
    gif = b"GIF89a" + struct.pack("<HH", 300, 200) + b"\x00" * 8
    assert image_size(gif) == (300, 200)
    jpeg = b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 16) + b"\x00" * 14 + b"\xff\xc0" + struct.pack(">H", 17) \
        + b"\x08" + struct.pack(">HH", 480, 640) + b"\x00" * 10
    assert image_size(jpeg) == (640, 480)
    assert image_size(b"not an image") is None


async def test_a_prompt_with_media_is_not_tokenized_for_the_precise_view() -> None:
    """Its media's blocks are keyed on identifiers no token id says: the approximate index routes it, and no pod is
    asked to tokenize (fetch and process) its images."""
    class Counting:
        def __init__(self) -> None:
            self.asked: list[str] = []

        async def token_ids(self, request: InferenceRequest, candidates: object) -> list[int] | None:
            self.asked.append(request.request_id)
            return [1, 2, 3]

        async def close(self) -> None:
            pass

    pool = EndpointPool()
    pool.set_endpoints([Endpoint.from_address("10.0.2.1:8000")])
    tokenizer = Counting()
    director = Director(pool, build_scheduler(rng=random.Random(0)), tokenizer=tokenizer, clock=lambda: 0.0)
    headers = {":path": "/v1/chat/completions", ":method": "POST"}
    with_image = build_request(headers, chat(image(data_url(png(64, 64))), TEXT), request_id="image")
    text_only = build_request(headers, chat(TEXT), request_id="text")
    for request in (with_image, text_only):
        await director.route(request)
    assert tokenizer.asked == ["text"]
    assert with_image.token_ids is None and text_only.token_ids == [1, 2, 3]


def test_an_invalid_data_url_is_the_clients_400() -> None:
    with pytest.raises(RequestError) as caught:
        parse(chat(image("data:image/png;base64,@@@not-base64@@@")))
    assert caught.value.status == 400 and caught.value.code == "invalid_media"


def test_other_apis_render_their_media_too() -> None:
    anthropic = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(64, 64)).decode()}}]}]}
    request = build_request({":path": "/v1/messages", ":method": "POST"}, json.dumps(anthropic).encode(),
                            request_id="r")
    assert request.api is ApiKind.MESSAGES and [i.kind for i in request.media] == ["image"]
    responses = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://images.example/a.png"}]}]}
    request = build_request({":path": "/v1/responses", ":method": "POST"}, json.dumps(responses).encode(),
                            request_id="r")
    assert [i.kind for i in request.media] == ["image"]


def test_the_media_scorer_follows_the_images_sent_to_each_pod() -> None:
    """A pod scores the share of the request's distinct images it was sent (any position, any text around)."""
    from picker.endpoints.state import Endpoint
    from picker.scheduling.context import SchedulingContext
    from picker.scheduling.media import MediaAffinityScorer

    pods = [Endpoint(f"10.0.0.{i}:8000", f"10.0.0.{i}", 8000) for i in (1, 2)]
    scorer = MediaAffinityScorer("media", entries_per_pod=2)
    cat, dog, fish = (image(data_url(png(32, 32, shade))) for shade in (1, 2, 3))

    def ctx(*parts: Mapping[str, object]) -> SchedulingContext:
        return SchedulingContext(request=parse(chat(*parts)), now=0.0, model="m")

    assert scorer.score(ctx(cat), pods) == [0.0, 0.0]
    scorer.on_picked(ctx(TEXT, cat), pods[0], 0.0)
    assert scorer.score(ctx({"type": "text", "text": "another question"}, cat, dog), pods) == [0.5, 0.0]
    scorer.on_picked(ctx(dog, fish), pods[0], 1.0)  # two entries a pod: the cat is forgotten
    assert scorer.score(ctx(cat), pods) == [0.0, 0.0]
    scorer.on_endpoint_removed(pods[0])
    assert scorer.score(ctx(dog), pods) == [0.0, 0.0]



def test_the_request_carries_its_media_even_a_marker_longer_than_its_tokens() -> None:
    request = parse(chat(TEXT, image(data_url(png(28, 28))), image("https://images.example/a.png")))
    assert [(m.kind, m.tokens) for m in request.media] == [("image", 4), ("image", 391)]
    assert parse(chat(TEXT)).media == ()
