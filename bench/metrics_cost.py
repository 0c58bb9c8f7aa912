"""What recording the picker's Prometheus series costs per request: `observe_routed` + `observe_finished` (the two
calls every routed request makes), timed in rounds on one PickerMetrics, with and without a response body seen.

    .venv/bin/python bench/metrics_cost.py [--rounds 3] [--requests 20000]

Prints µs per request for each round; compare revisions by running it on each checkout in one session.
"""

from __future__ import annotations

import argparse
import timeit

from picker.core.requests import InferenceRequest, Usage
from picker.endpoints.state import Endpoint
from picker.routing.observers import ResponseTrace
from picker.serving.metrics import PickerMetrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    metrics = PickerMetrics("pool")
    request = InferenceRequest(request_id="r", model="m", stream=True)
    pod = Endpoint.from_address("10.0.0.1:8000")
    usage = Usage(100, 10, 50)

    def headers_only() -> None:
        metrics.requests.observe_routed(request, 0.001, 1, 2, pod, 64)
        metrics.requests.observe_finished(request, 1.0, None)

    def with_body() -> None:
        metrics.requests.observe_routed(request, 0.001, 1, 2, pod, 64)
        trace = ResponseTrace(0.0, metrics.requests.itl_observer(request))
        for at in (0.1, 0.12, 0.14, 0.16, 0.18):
            trace.on_chunk(at, 120, 0.00002)
        metrics.requests.observe_finished(request, 1.0, usage, trace)

    for name, call in (("response body not seen (buffered)", headers_only),
                       ("response body seen, 5 chunks (full-duplex)", with_body)):
        for i in range(args.rounds):
            seconds = timeit.timeit(call, number=args.requests)
            print(f"{name}, round {i + 1}: {seconds / args.requests * 1e6:.2f} µs per request")


if __name__ == "__main__":
    main()
