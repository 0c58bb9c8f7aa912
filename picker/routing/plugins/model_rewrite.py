"""Model rewrite (the reference's InferenceModelRewrite, and its `x-gateway-model-name-rewrite` header): the pod is
asked for the target model, in the body it gets (another body, another content-length), and the client reads its
own model name back in every response chunk."""

from __future__ import annotations

from picker.core import headers as names
from picker.core.model_rewrite import ModelRewrites, body_for_target, response_swaps, swap_models
from picker.core.requests import InferenceRequest
from picker.routing.decision import Decision
from picker.routing.lifecycle import PluginDeps, RequestPlugin


class ModelRewrite(RequestPlugin):
    name = "model-rewrite"

    def __init__(self, rewrites: ModelRewrites) -> None:
        self.rewrites = rewrites

    def resolve(self, request: InferenceRequest) -> None:
        if self.rewrites:
            self.rewrites.apply(request)  # sets request.target_model; the header's target is set when parsed

    def placed(self, decision: Decision, body: bytes) -> None:
        request = decision.request
        target = request.target_model
        if target is None or target == request.model or not request.has_body or not body:
            return
        decision.body = body_for_target(body, target)
        decision.set_header(names.CONTENT_LENGTH, str(len(decision.body)))
        decision.keep(self.name, response_swaps(target, request.model))

    def response_chunk(self, decision: Decision, chunk: bytes, end: bool, began: float) -> bytes:
        swaps = decision.kept(self.name)
        return swap_models(chunk, swaps) if swaps else chunk


def factory(deps: PluginDeps) -> ModelRewrite:
    """Always: the header rewrites a request without any rule configured."""
    return ModelRewrite(deps.rewrites)
