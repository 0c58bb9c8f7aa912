"""Images and audio on a real vLLM: how many tokens it counts for one, and do requests sharing an image stay on its
pod? (opt-in: vLLM 0.32 CPU, ~3 minutes)

    make media-real     # or: .venv/bin/python bench/media_real.py [--groups 6]

Builds a random-weight Idefics3 and Qwen2-Audio (lab/picker_lab/bench/vllm_media.py says why those architectures:
Qwen2-VL cannot run here), starts two vLLM CPU servers of the first, one per core, then one of the second.

Token counts: one chat per image size (the ten of `make media-tokens`), the image and a line of text, sent to one
server; vLLM's count for the image (`usage.prompt_tokens_details.multimodal_tokens`) beside the picker's estimate
for the model's processor family (`imageLayout: tiles`) and the default one (`patches`, Qwen2-VL's), and vLLM's
prompt tokens beside the picker's estimate of the whole prompt. Audio: one chat per clip length (a 16 kHz WAV),
vLLM's count for the clip beside the picker's default estimate.

Routing: Envoy in front of both servers with the picker (that `multimodal:` section; approximate, then precise on
the servers' KV events), then alone (round-robin); each run's preambles its own. `--groups` images, each after a
preamble of its own, sent four times one at a time with a different question after the image: as data URLs (PNG
bytes in the request) and as remote URLs served on loopback (vLLM fetches them; the picker never does). Which
server answered each (Envoy's upstream host) and what vLLM served from its prefix cache; with the picker, two
other images of the same size after the same preamble, what it believed their pod held against what vLLM served
from cache. Writes bench/out/media_real.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.server
import json
import random
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from media_tokens import SIZES  # noqa: E402

from picker.api.v1 import picker_pb2, picker_pb2_grpc  # noqa: E402
from picker.core.media import DEFAULT_MEDIA, MediaTokens, MultimodalConfig, image_tokens  # noqa: E402
from picker.core.requests import CHARS_PER_TOKEN, InferenceRequest, build_request, estimated_tokens  # noqa: E402
from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.bench import vllm_media  # noqa: E402
from picker_lab.bench.live import start_direct_envoy  # noqa: E402
from picker_lab.media_files import data_url, png, wav  # noqa: E402
from picker_lab.supervisor import (  # noqa: E402
    HOST,
    Picker,
    PickerFleet,
    free_port,
    process_scope,
    start_picker_fleet,
    wait_until,
)

TILES = {"imageLayout": "tiles"}  # the processor family of Idefics3 and SmolVLM; its defaults are Idefics3's
SERVED_BY = "x-served-by"
AUDIO_SECONDS = [0.3, 1.0, 2.5, 5.0, 10.0, 29.0, 30.0, 45.0, 60.0]
BLOCKS = 2048  # per server: every group's images fit


def start_picker_for(logdir: Path, pool: list[str], config: Path, flags: list[str], name: str,
                     served_by: str = "") -> PickerFleet:
    """The picker (its `config` file, `flags`) behind Envoy, once it routes to every server of `pool`."""
    fleet = start_picker_fleet(logdir, pool, flags=["--config-file", str(config), *flags], name=name,
                               served_by=served_by)
    picker = fleet.pickers[0]
    try:
        wait_until(lambda: picker.routes_to(set(pool)), 30, "the picker's pods", picker.process)
    except BaseException:
        for process in reversed(fleet.processes):
            process.stop()
        raise
    return fleet


def chat(url: str, before: str, after: str) -> dict[str, Any]:
    content = [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": after}]
    return {"model": engine.MODEL_NAME, "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "user", "content": content}]}


def parsed(body: dict[str, Any], media: MultimodalConfig = DEFAULT_MEDIA) -> InferenceRequest:
    """`body` as the picker reads it (its media counted by `media`)."""
    return build_request({":path": "/v1/chat/completions", ":method": "POST"}, json.dumps(body).encode(),
                         request_id="estimate", media=media)


def picker_estimate(body: dict[str, Any], media: MultimodalConfig) -> int:
    """The picker's estimate of the prompt's tokens (its default characters per token, less the answer's)."""
    request = parsed(body, media)
    return estimated_tokens(request, CHARS_PER_TOKEN) - (request.max_tokens or 0)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["usage"], response.headers.get(SERVED_BY, "")


async def token_counts(server_url: str) -> list[dict[str, Any]]:
    tiles = MultimodalConfig.from_dict({"models": {engine.MODEL_NAME: TILES}})
    rows = []
    async with aiohttp.ClientSession() as session:
        for width, height in SIZES:
            body = chat(data_url(png(width, height, 128)), "look:", "what is in this picture?")
            usage, _ = await post(session, server_url, body)
            theirs = usage["prompt_tokens_details"]["multimodal_tokens"]["image"]
            rows.append({"size": f"{width}x{height}", "vllm_image": theirs,
                         "picker_tiles": image_tokens(width, height, tiles.for_model(engine.MODEL_NAME)),
                         "picker_patches": image_tokens(width, height, MediaTokens()),
                         "vllm_prompt": usage["prompt_tokens"], "picker_prompt": picker_estimate(body, tiles)})
    return rows


async def audio_counts(server_url: str) -> list[dict[str, Any]]:
    """vLLM's count for a clip of each length (`usage.prompt_tokens_details.multimodal_tokens`) beside the
    picker's estimate (the default `multimodal` config: Qwen2-Audio's 25 a second, 30 seconds at most)."""
    rows = []
    async with aiohttp.ClientSession() as session:
        for seconds in AUDIO_SECONDS:
            clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(seconds, tone=True)).decode(),
                                                           "format": "wav"}}
            body = {"model": engine.MODEL_NAME, "max_tokens": 1,
                    "messages": [{"role": "user", "content": [clip, {"type": "text", "text": "what is said?"}]}]}
            usage, _ = await post(session, server_url, body)
            rows.append({"seconds": seconds, "vllm_audio": usage["prompt_tokens_details"]["multimodal_tokens"]["audio"],
                         "picker": parsed(body).media[0].tokens})
    return rows


class ImageServer:
    """Images on a loopback HTTP server, for the remote-URL requests (vLLM fetches them)."""

    def __init__(self, images: dict[str, bytes]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                data = images.get(self.path.lstrip("/"))
                self.send_response(200 if data else 404)
                self.send_header("content-type", "image/png")
                self.end_headers()
                self.wfile.write(data or b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{HOST}:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def claimed_tokens(picker: Picker, body: dict[str, Any]) -> tuple[str, int]:
    """The pod the picker would pick for `body` and the prompt tokens it believes that pod holds (Explain)."""
    async with picker.aio_channel() as channel:
        answer = await picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
            path="/v1/chat/completions", body=json.dumps(body).encode()))
    return answer.ranked[0], answer.prefix_matched_blocks * vllm_media.BLOCK_SIZE  # a block: block_size tokens


async def routing(envoy_url: str, groups: int, seed: int, picker: Picker | None = None) -> dict[str, Any]:
    """Each group: an image after a preamble of its own, four times with another question after it; with `picker`,
    then two other images of the same size after the same preamble, what the picker believes their pod holds
    (Explain) beside what vLLM served from cache."""
    rng = random.Random(seed)
    vocabulary = engine.vocabulary()
    sizes = [(rng.choice((640, 800, 1024)), rng.choice((480, 600, 768))) for _ in range(groups)]
    images = {f"img-{g}-{v}.png": png(*size, 10 + g * 20 + v * 7) for g, size in enumerate(sizes) for v in range(3)}
    remote = ImageServer(images)
    results: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for kind in ("data", "remote"):
                on_home = follow_ups = cached = prompt = 0
                homes: list[str] = []
                others: list[dict[str, int]] = []
                for g in range(groups):
                    urls = [data_url(images[name]) if kind == "data" else f"{remote.url}/{name}"
                            for name in (f"img-{g}-{v}.png" for v in range(3))]
                    before = " ".join(rng.choice(vocabulary) for _ in range(60))
                    home = ""
                    for turn in range(4):
                        question = f"question {g}.{turn}: " + " ".join(rng.choice(vocabulary) for _ in range(8))
                        usage, served_by = await post(session, envoy_url, chat(urls[0], before, question))
                        if not turn:
                            home = served_by
                            homes.append(home)
                            continue
                        follow_ups += 1
                        on_home += served_by == home
                        prompt += usage["prompt_tokens"]
                        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for variant in (1, 2):
                        if picker is None:
                            break
                        body = chat(urls[variant], before, f"and this one, {variant}?")
                        pick, believed = await claimed_tokens(picker, body)
                        usage, served_by = await post(session, envoy_url, body)
                        others.append({"believed": believed, "same_pod": served_by == pick,
                                       "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0})
                results[kind] = {"follow_ups": follow_ups, "on_first_pod": on_home, "prompt_tokens": prompt,
                                 "cached_tokens": cached, "first_pods": homes, "other_images": others}
    finally:
        remote.close()
    return results


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    engine.install()
    model = vllm_media.build_media_model("idefics3")
    audio_model = vllm_media.build_media_model("qwen2-audio")
    with process_scope("media-real") as (logdir, started):
        # Both publish their KV events to the endpoint the precise picker binds (dropped until it does).
        endpoint, ports = f"tcp://{HOST}:{free_port()}", [free_port(), free_port()]
        servers = [vllm_media.start_media_server(
            model, f"vllm-{i}", cpu=i, num_blocks=BLOCKS, port=port,
            extra=tuple(engine.kv_events_flags(endpoint, f"kv@{HOST}:{port}@{engine.MODEL_NAME}")))
            for i, port in enumerate(ports)]
        try:
            for server in servers:
                server.wait_healthy()
            counts = await token_counts(servers[0].url)
            pool = [server.address for server in servers]
            config = logdir / "media.yaml"
            config.write_text(json.dumps({"multimodal": {"models": {engine.MODEL_NAME: TILES}}}))
            routed = {}
            for seed, (mode, flags) in enumerate((
                    ("picker", []),
                    ("picker, precise", ["--kv-events-endpoint", endpoint, "--prefix-mode", "precise"])), start=1):
                fleet = start_picker_for(logdir, pool, config, flags, f"picker-{seed}", served_by=SERVED_BY)
                started.extend(fleet.processes)
                routed[mode] = await routing(fleet.envoy.url, args.groups, seed, fleet.pickers[0])
                for process in reversed(fleet.processes):
                    process.stop()
            direct, direct_url = start_direct_envoy(logdir, pool, served_by=SERVED_BY)
            started.append(direct)
            routed["round-robin"] = await routing(direct_url, args.groups, seed=3)
        finally:
            for server in servers:
                server.stop()
        audio = vllm_media.start_media_server(audio_model, "vllm-audio", cpu=0, num_blocks=BLOCKS)
        try:
            audio.wait_healthy()
            audio_rows = await audio_counts(audio.url)
        finally:
            audio.stop()
    result = {"token_counts": counts, "audio_counts": audio_rows, "routing": routed, "groups": args.groups}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "media_real.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (args.out / "media_real.md").write_text(text)
    print(text)
    return 0


def report(result: dict[str, Any]) -> str:
    lines = ["# Images on a real vLLM 0.32 CPU server (a random-weight Idefics3)", "",
             "## Tokens: vLLM's count and the picker's estimate", "",
             "| image | vLLM | picker, tiles | tiles / vLLM | picker, patches (default) | vLLM prompt | picker prompt |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for row in result["token_counts"]:
        ratio = row["picker_tiles"] / row["vllm_image"]
        worst = max(worst, abs(ratio - 1))
        lines.append(f"| {row['size']} | {row['vllm_image']} | {row['picker_tiles']} | {ratio:.3f} | "
                     f"{row['picker_patches']} | {row['vllm_prompt']} | {row['picker_prompt']} |")
    lines += ["", f"Largest difference with the model's family: {worst:.1%}.", "",
              "## Audio: vLLM's count and the picker's estimate (a random-weight Qwen2-Audio, 16 kHz WAV)", "",
              "| seconds | vLLM | picker | picker / vLLM |", "|---:|---:|---:|---:|"]
    for row in result["audio_counts"]:
        lines.append(f"| {row['seconds']:g} | {row['vllm_audio']} | {row['picker']} | "
                     f"{row['picker'] / row['vllm_audio']:.3f} |")
    lines += ["",
              "## Routing: Envoy in front of two servers, with the picker and without (round-robin)", "",
              f"{result['groups']} images, each after a preamble of its own, sent four times one at a time.", "",
              "| routing | image as | follow-ups on the first's pod | follow-ups' prompt tokens from cache | "
              "first requests' pods |", "|---|---|---:|---:|---|"]
    for router, kinds in result["routing"].items():
        for kind, r in kinds.items():
            pods = ", ".join(f"{pod} x{r['first_pods'].count(pod)}" for pod in sorted(set(r["first_pods"])))
            share = r["cached_tokens"] / max(1, r["prompt_tokens"])
            lines.append(f"| {router} | {kind} URL | {r['on_first_pod']}/{r['follow_ups']} | "
                         f"{share:.0%} ({r['cached_tokens']}/{r['prompt_tokens']}) | {pods} |")
    lines += ["", "Another image of the same size after the same preamble: the tokens the picker believed its pod held "
              "(Explain, just before) and the tokens vLLM served from cache, summed.", "",
              "| routing | image as | requests | believed held | served from cache | sent where Explain picked |",
              "|---|---|---:|---:|---:|---:|"]
    for router, kinds in result["routing"].items():
        for kind, r in kinds.items():
            others = r["other_images"]
            if others:
                lines.append(f"| {router} | {kind} URL | {len(others)} | {sum(o['believed'] for o in others)} | "
                             f"{sum(o['cached'] for o in others)} | {sum(o['same_pod'] for o in others)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
