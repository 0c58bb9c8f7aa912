"""The simulated pod's routes besides generation: `/v1/models`, health and version, `/metrics` (each scrape holds the
pod's API server, as vLLM's does), tokenize and render, the peers' server and model info, and the prefix cache
reset; with the JSON helpers every route shares. A part of `SimPod` (server.py), whose state they read."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from picker.endpoints.metrics import only_named_samples
from picker_lab.sim.dialects import MetricsPage
from picker_lab.sim.engine import Engine
from picker_lab.sim.kv_events import KVEventPublisher
from picker_lab.sim.openai_api import (
    ApiError,
    ServedModel,
    chat_prompt,
    check_messages,
    check_text,
    json_bytes,
    prompt_token_lists,
    resolve_model,
)

if TYPE_CHECKING:
    from picker_lab.sim.server import PodConfig

# What a scrape of the cut-down page costs against the whole one's: real vLLM 0.32's API server spent 1.7-2.0 ms idle
# and 0.9-1.1 ms under traffic against 5.1-5.4 and 3.6-3.7 (bench/results/scrape-cost/run1-series-read)
NAMED_SCRAPE_SHARE = 0.3
VLLM_VERSION = "0.32.0"


class InfoRoutes:
    name: str
    model_name: str
    engine: Engine
    served: ServedModel
    publisher: KVEventPublisher | None
    config: PodConfig
    started: float
    _api_free_at: float
    _engine_failure: BaseException | None

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=json_bytes(obj), status=status, content_type="application/json")

    @staticmethod
    async def _body(request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ApiError("Invalid JSON in request body.", 400) from None

    async def _api_turn(self) -> None:
        """Wait while this pod's API server is busy rendering /metrics (profile.scrape_cost_s per scrape)."""
        delay = self._api_free_at - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the base model and the LoRA adapters."""
        created = int(self.started)

        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {
                "id": mid,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_DNS, self.name + mid).hex[:16]}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        data = [card(self.model_name, self.served.root, None, self.served.max_model_len)]
        data += [card(name, path, self.model_name, None) for name, path in self.served.lora_modules.items()]
        return self._json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 with an empty body, like vLLM; 503 once the engine loop has died, as vLLM's."""
        return web.Response(status=503 if self._engine_failure is not None else 200)

    async def version(self, request: web.Request) -> web.Response:
        """GET /version."""
        return self._json({"version": VLLM_VERSION})

    def metrics_handler(self, page: MetricsPage, names: bool = False) -> Callable[[web.Request],
                                                                                Awaitable[web.Response]]:
        """GET of one metrics page (vLLM's /metrics, or the engine dialect's); with a scrape cost, it holds the
        API server that long (model time). With `names`, the page cut down to the samples the GET names, at
        `NAMED_SCRAPE_SHARE` of the cost."""

        async def handle(request: web.Request) -> web.Response:
            cost = self.config.profile.scrape_cost_s * (NAMED_SCRAPE_SHARE if names else 1.0)
            if cost > 0:
                now = asyncio.get_running_loop().time()
                self._api_free_at = max(now, self._api_free_at) + cost / self.config.time_scale
                await self._api_turn()
            body = page.render()
            if names:
                body = only_named_samples(body.decode(), request.query.getall("name[]", [])).encode()
            return web.Response(body=body, headers={"Content-Type": page.content_type})

        return handle

    def _tokens_of(self, body: Any) -> list[list[int]]:
        if not isinstance(body, dict):
            raise ApiError("Request body must be a JSON object.", 400)
        check_text(body)
        resolve_model(body, self.served)
        if "messages" in body:
            return [chat_prompt(body, self.served.tokenizer)]
        return prompt_token_lists(body.get("prompt"), self.served.tokenizer, bool(body.get("add_special_tokens", True)))

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize (prompt or messages) -> {count, max_model_len, tokens, token_strs}."""
        tokens = self._tokens_of(await self._body(request))[0]
        return self._json(
            {"count": len(tokens), "max_model_len": self.served.max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def render_completion(self, request: web.Request) -> web.Response:
        """POST /v1/completions/render -> [{"token_ids": [...]}] per prompt (what vllm-router reads)."""
        return self._json([{"token_ids": t} for t in self._tokens_of(await self._body(request))])

    async def render_chat(self, request: web.Request) -> web.Response:
        """POST /v1/chat/completions/render -> [{"token_ids": [...]}]."""
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ApiError("Request body must be a JSON object.", 400)
        check_messages(body.get("messages"))
        return self._json([{"token_ids": t} for t in self._tokens_of(body)])

    async def server_info(self, request: web.Request) -> web.Response:
        """GET /get_server_info (sglang-router probes it)."""
        p = self.engine.profile
        return self._json(
            {
                "model_path": self.served.root,
                "tokenizer_path": self.served.root,
                "served_model_name": self.model_name,
                "max_model_len": p.max_model_len,
                "context_length": p.max_model_len,
                "max_num_seqs": p.max_num_seqs,
                "max_num_batched_tokens": p.max_num_batched_tokens,
                "block_size": p.block_size,
                "page_size": p.block_size,
                "num_gpu_blocks": p.num_gpu_blocks,
                "max_total_num_tokens": p.num_gpu_blocks * p.block_size,
                "enable_prefix_caching": self.engine.kv.enable_prefix_caching,
                "version": VLLM_VERSION,
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        """GET /get_model_info (sglang-router probes it)."""
        return self._json(
            {
                "model_path": self.served.root,
                "tokenizer_path": self.served.root,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache (vLLM dev endpoint); 500 while requests hold blocks."""
        if not self.engine.reset_prefix_cache():
            raise ApiError("Failed to reset prefix cache: blocks are in use.", 500)
        if self.publisher is not None:
            self.publisher.publish(self.engine.kv.drain_events())
        return web.Response(status=200)
