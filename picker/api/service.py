"""picker.v1.Picker: the Explain and ListEndpoints calls, answered from the live director and pool."""

from __future__ import annotations

import grpc

import picker.api  # noqa: F401 - says how to build the stubs when they are missing
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.core.requests import RequestError, build_request
from picker.routing.director import Director


async def explain(director: Director, message: picker_pb2.ExplainRequest) -> picker_pb2.ExplainResponse:
    """Run the director's ranking on a request without routing it: nothing is recorded. The prompt is tokenized
    as a routed one is, so the precise view (the pods' KV events) is part of the answer."""
    headers = {k.lower(): v for k, v in message.headers.items()}
    headers[":path"] = message.path or "/v1/chat/completions"
    headers.setdefault(":method", "POST")
    subset = tuple(message.subset) if message.subset else None
    response = picker_pb2.ExplainResponse()
    try:
        request = build_request(headers, message.body, request_id="explain", subset=subset, media=director.media)
        now = director.clock()
        for name, value in director.screen(request, now).items():  # a request refused at once: its refusal
            response.admission[name] = value
        response.priority = request.priority
        await director.tokenize(request)
        result = director.rank(request, director.clock())
    except RequestError as err:
        response.error_status, response.error_code, response.error_message = err.status, err.code, err.message
        return response
    response.ranked.extend(e.address for e in result.ranked)
    if result.ranked:
        response.destination = result.ranked[0].destination
        response.data_parallel_rank = result.ranked[0].rank
    response.profile = result.profile
    response.profile_reason = result.profile_reason
    for name, weight in result.weights.items():
        response.weights[name] = weight
    for item in request.media:
        response.media.add(kind=item.kind, digest=item.digest, tokens=item.tokens, source=item.source)
    response.prefix_blocks = result.prefix_blocks
    response.prefix_matched_blocks = result.prefix_matched_blocks
    for candidate in result.candidates:
        item = response.candidates.add(address=candidate.endpoint.address, total=candidate.total,
                                       filtered_by=candidate.filtered_by or "")
        for name, score in candidate.scores.items():
            item.scores[name] = score
        for name, value in candidate.details.items():
            item.details[name] = value
    return response


class PickerService(picker_pb2_grpc.PickerServicer):
    def __init__(self, director: Director) -> None:
        self.director = director

    async def Explain(self, request: picker_pb2.ExplainRequest, context: grpc.aio.ServicerContext  # noqa: N802
                      ) -> picker_pb2.ExplainResponse:
        return await explain(self.director, request)

    async def ListEndpoints(self, request: picker_pb2.ListEndpointsRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> picker_pb2.ListEndpointsResponse:
        now = self.director.clock()
        response = picker_pb2.ListEndpointsResponse()
        for e in self.director.pool.targets():
            age = e.metrics_age(now)
            response.endpoints.add(
                address=e.address, name=e.name, healthy=e.healthy, waiting=e.metrics.waiting,
                running=e.metrics.running, kv_cache_usage=e.metrics.kv_usage, in_flight=e.in_flight,
                in_flight_tokens=e.in_flight_tokens, metrics_age_seconds=age if age != float("inf") else -1.0,
                block_size=e.metrics.block_size or 0, num_gpu_blocks=e.metrics.num_gpu_blocks or 0,
                running_lora_adapters=sorted(e.metrics.running_loras), state=e.state.value,
                data_parallel_rank=e.rank, destination=e.destination,
            )
        return response
