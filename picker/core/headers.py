"""Every HTTP header the picker reads, sets or removes: one list, so the code, docs/protocol.md and the Envoy
`mutation_rules` that `picker envoy-config` writes cannot disagree.

An operator may lock an external processor down to named headers (`mutation_rules: {disallow_all: true,
allow_expression: ...}`); with `disallow_is_error` Envoy then fails the whole request on any other mutation,
even the removal of a header that is not there. So the picker touches a header only when a feature in use needs
it, and removes one only when the request carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Read from the client's request --------------------------------------------------------------------------
OBJECTIVE = "x-gateway-inference-objective"  # the objective's name -> the request's priority
FAIRNESS_ID = "x-llm-d-inference-fairness-id"  # the reference's flow-control tenant
GATEWAY_FAIRNESS_ID = "x-gateway-inference-fairness-id"  # GIE's name for the same
MODEL_REWRITE = "x-gateway-model-name-rewrite"  # the model name the pod gets (set by the gateway)
SESSION_ID = "x-session-id"  # session affinity
SLO_TTFT = "x-slo-ttft-ms"  # llm-d's name for a request's time-to-first-token objective

# Set on the request the pod gets -----------------------------------------------------------------------------
DESTINATION = "x-gateway-destination-endpoint"  # the chosen pod, "ip:port"
REQUEST_ID = "x-request-id"  # read; set only when the request has none (Envoy normally generates it)
CONTENT_LENGTH = "content-length"  # read; set when the model name in the body is rewritten (another length)
PREFILLER = "x-prefiller-host-port"  # P/D: the prefill pod ("ip:port") the decode pod's sidecar prefills on
PREFILLER_RANK = "x-prefiller-data-parallel-rank"  # P/D: the prefill pod's engine, when it is a rank of its server
DATA_PARALLEL_RANK = "x-data-parallel-rank"  # the engine of a data-parallel server that gets it (vLLM, SGLang)

# Set on the picker's own answers (errors, the model listing) ------------------------------------------------
CONTENT_TYPE = "content-type"
RETRY_AFTER = "retry-after"  # on 429 and 503
ALLOW = "allow"  # on 405: the method an inference API takes
DROPPED_REASON = "x-llm-d-request-dropped-reason"  # flow control's drops (the reference picker's header)


@dataclass(frozen=True, slots=True)
class MutatedHeader:
    """A header the picker may set or remove, on which message, and when."""

    name: str
    on: str  # "request" (to the pod) or "answer" (the picker's immediate response to the client)
    when: str
    disaggregation_only: bool = False


MUTATED: tuple[MutatedHeader, ...] = (
    MutatedHeader(DESTINATION, "request", "set on every routed request"),
    MutatedHeader(REQUEST_ID, "request", "set when the request carries none (Envoy generates one unless "
                  "`generate_request_id: false`)"),
    MutatedHeader(CONTENT_LENGTH, "request", "set when the model name in the body is rewritten (a rewrite rule, or "
                  f"`{MODEL_REWRITE}` from the gateway), in BUFFERED mode and FULL_DUPLEX_STREAMED alike"),
    MutatedHeader(PREFILLER, "request", "with P/D configured only: set when a prefill pod is chosen; removed when "
                  "the client's request carries it and no prefill pod is chosen", disaggregation_only=True),
    MutatedHeader(PREFILLER_RANK, "request", "with P/D configured only: set when the prefill pod chosen is one rank "
                  "of a server with several data-parallel ranks behind one port (the sidecar hands it to that "
                  "engine); removed when the client's request carries it otherwise", disaggregation_only=True),
    MutatedHeader(DATA_PARALLEL_RANK, "request", "set when the pick is one rank of a server with several "
                  "data-parallel ranks behind one port; removed when the client's request carries it and the pick "
                  "is a whole server"),
    MutatedHeader(CONTENT_TYPE, "answer", "`application/json` on every answer of the picker's own"),
    MutatedHeader(RETRY_AFTER, "answer", "on a 429 or 503 the client may retry"),
    MutatedHeader(ALLOW, "answer", "on a 405 (an inference API asked with another method than POST)"),
    MutatedHeader(DROPPED_REASON, "answer", "on a request flow control drops (queue full, TTL, token budget)"),
)


def mutated_names(*, disaggregation: bool) -> tuple[str, ...]:
    """The headers the picker may set or remove with P/D configured or not: what an ext_proc filter's
    `mutation_rules` must allow."""
    return tuple(h.name for h in MUTATED if disaggregation or not h.disaggregation_only)
