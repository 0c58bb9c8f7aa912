"""`picker demo`'s burst: many chats at once, so the picker is seen at work under load. They share a system prompt
one pod already holds, yet they spread over the pods by load; what the pool has no room for waits in the picker's
queue (flow control); a sheddable request sent while the pool is full is shed at once with 429.

The demo runs its pods with two running sequences each and its pickers with the admission below, so a dozen
requests fill the pool on any machine.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from picker.core.headers import DROPPED_REASON, OBJECTIVE
from picker_lab.supervisor import Picker, metric_sum

BURST = 12
POD_SEQUENCES = 2  # the simulated pods' --max-num-seqs: a burst finds them full
SERVED_BY = "x-served-by"  # the demo's Envoy names the pod that answered (supervisor.start_envoy's served_by)
# The demo pickers' admission: a pod with two requests waiting is full; flow control queues what finds the pool
# full; the "batch" objective is sheddable (priority -1).
ADMISSION = {"admission": {"objectives": {"batch": -1}, "queueThreshold": POD_SEQUENCES,
                           "flowControl": {"enabled": True}}}
ENQUEUED = "llm_d_epp_flow_control_request_enqueue_duration_seconds_count"
QUEUE_SIZE = "llm_d_epp_flow_control_queue_size"


@dataclass(slots=True)
class Answer:
    status: int
    pod: str  # the address Envoy says answered ("" for the picker's own answers)
    body: str
    dropped_reason: str = ""


def send(url: str, body: dict[str, Any] | bytes | None, headers: dict[str, str] | None = None,
         method: str = "POST") -> Answer:
    """One request through the demo's Envoy (a JSON body, raw bytes or none); an error status is an answer too."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Answer(response.status, response.headers.get(SERVED_BY, ""), response.read().decode(errors="replace"))
    except urllib.error.HTTPError as err:
        return Answer(err.code, "", err.read().decode(errors="replace"), err.headers.get(DROPPED_REASON, ""))


def metric(picker: Picker, name: str, **labels: str) -> float:
    """A series of a picker's /metrics, summed over the label sets that match `labels`."""
    return metric_sum(f"{picker.host}:{picker.metrics_port}", name, **labels)


@dataclass(slots=True)
class Burst:
    answers: list[Answer]
    queued: int  # requests of the burst that waited in a picker's queue for room
    sheddable: Answer  # the sheddable request sent while the pool was full
    pool_was_full: bool  # a picker held requests in its queue when the sheddable one was sent


def run_burst(url: str, pickers: Sequence[Picker], chat: Any) -> Burst:
    """BURST chats at once (`chat(question)` builds a body), then, once a picker queues some, a sheddable one."""
    before = sum(metric(p, ENQUEUED, outcome="Enqueued") for p in pickers)
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(send, url, chat(f"Question {i}: which runbook section covers incident {i}?"))
                   for i in range(BURST)]
        deadline = time.monotonic() + 5.0
        full = False
        while not full and time.monotonic() < deadline and not all(f.done() for f in futures):
            full = any(metric(p, QUEUE_SIZE) > 0 for p in pickers)
            if not full:
                time.sleep(0.01)
        sheddable = send(url, chat("A batch job's question, sheddable."), {OBJECTIVE: "batch"})
        answers = [f.result() for f in futures]
    queued = int(sum(metric(p, ENQUEUED, outcome="Enqueued") for p in pickers) - before)
    return Burst(answers, queued, sheddable, full)


def describe(burst: Burst, held_by: str) -> list[str]:
    """The lines the demo prints for a burst: where it went, what waited, what was shed."""
    statuses = Counter(a.status for a in burst.answers)
    pods = Counter(a.pod for a in burst.answers if a.status == 200)
    spread = ", ".join(f"{pod} {n}" for pod, n in sorted(pods.items()))
    lines = [f"-> {' + '.join(f'{n} x {s}' for s, n in sorted(statuses.items()))}; served by {spread}"]
    if held_by:
        lines.append(f"   the prefix is on {held_by}: cache affinity alone would send all {BURST} there; the load "
                     "scorers spread them")
    lines.append(f"-> {burst.queued} of {BURST} waited in the picker's queue for room (flow control: each pod runs "
                 f"{POD_SEQUENCES} at a time here), none was refused")
    shed = burst.sheddable
    when = "while the pool was full" if burst.pool_was_full else "(the pool had room again when it came)"
    if shed.status == 200:
        lines.append(f"-> sheddable request ({OBJECTIVE}: batch) {when}: 200, served by {shed.pod}")
    else:
        code = ""
        with contextlib.suppress(ValueError, KeyError, TypeError):
            code = json.loads(shed.body)["error"]["code"]
        lines.append(f"-> sheddable request ({OBJECTIVE}: batch) {when}: {shed.status} {code} "
                     f"({DROPPED_REASON}: {shed.dropped_reason or '-'}): shed at once, nothing queued for it")
    return lines
