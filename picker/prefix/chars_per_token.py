"""Characters per token of the traffic, learned from what the pods already report: no call of our own.

The prefix index cuts prompts into character blocks and sizes each pod's share of it from the pod's KV cache in
tokens, so it needs characters per token. English under a Llama tokenizer is about 4 (the configured
`prefixCache.charsPerToken`), code and other languages fewer: a benchmark's vocabulary gave 2.7, which made the
index believe each pod holds 1.5x what it can, and keep routing prefixes to pods that had evicted them.

Every vLLM pod counts the prompt tokens of the requests it finished (`vllm:request_prompt_tokens` sum and count,
scraped anyway); the picker knows the characters of the prompts it sent. Tokens per request on a pod over
characters per request we sent it, once enough of both have accrued, is one sample; the estimate follows the
samples with exponential smoothing. Per request, not totals: the other replicas' picks, heard through the shared
index, count with ours (the pod's counters count their requests too, and a sample comes as many times sooner), and
a replica that hears none reads the same ratio from its own part of the pod's traffic. Replicas report their
estimate to each other (the shared load), and one that has just started routes on theirs until it has a sample of
its own. A pod that does not report the histogram (other engines) leaves the configured value in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from picker.core.replicas import ReplicaView
from picker.endpoints.state import Endpoint

# Fewer requests than this on either side and a sample is mostly noise (one long prompt among short ones).
MIN_REQUESTS = 16
SMOOTHING = 0.3
# Beyond these the counters are not measuring the same requests (a pod restarted, a counter reset).
LOWEST, HIGHEST = 0.5, 16.0


@dataclass
class _Tally:
    """Since the last sample: the pod's counters then, and what we sent it since."""

    tokens: float
    requests: float
    chars: float = 0.0
    picks: int = 0


class CharsPerToken:
    """The estimate (`value`), fed by every pick. With `replicas` (replicas sharing a pool), the estimate is
    reported to the others, and until this replica has a sample of its own it is theirs."""

    def __init__(self, configured: float, min_requests: int = MIN_REQUESTS, smoothing: float = SMOOTHING,
                 replicas: ReplicaView | None = None) -> None:
        if configured <= 0 or min_requests < 1 or not 0 < smoothing <= 1:
            raise ValueError("chars per token must be positive, min_requests >= 1, smoothing within (0, 1]")
        self.replicas = replicas
        self.value = configured
        self.min_requests = min_requests
        self.smoothing = smoothing
        self.samples = 0
        self._pods: dict[str, _Tally] = {}

    def picked(self, endpoint: Endpoint, prompt_chars: int) -> None:
        """A prompt of `prompt_chars` characters went to `endpoint` (its last scraped counters are read too)."""
        m = endpoint.metrics
        if math.isnan(m.prompt_count):  # another replica's scrape from a release that did not share the counters
            return
        tally = self._pods.get(endpoint.address)
        if tally is None or m.prompt_count < tally.requests:  # first sight, or the counters went back
            self._pods[endpoint.address] = _Tally(m.prompt_tokens, m.prompt_count, float(prompt_chars), 1)
            return
        tally.chars += prompt_chars
        tally.picks += 1
        finished = m.prompt_count - tally.requests
        if finished < self.min_requests or tally.picks < self.min_requests:
            return
        tokens = m.prompt_tokens - tally.tokens
        if tokens > 0 and tally.chars > 0:
            sample = (tally.chars / tally.picks) / (tokens / finished)
            if LOWEST <= sample <= HIGHEST:
                self.value += self.smoothing * (sample - self.value)
                self.samples += 1
                if self.replicas is not None:
                    self.replicas.chars_per_token = self.value
        self._pods[endpoint.address] = _Tally(m.prompt_tokens, m.prompt_count)

    def follow_peers(self) -> None:
        """Until this replica has a sample of its own, the figure the other replicas report (when they do)."""
        replicas = self.replicas
        if not self.samples and replicas is not None and replicas.peers_chars_per_token is not None:
            self.value = replicas.peers_chars_per_token

    def peer_picked(self, address: str, prompt_chars: int) -> None:
        """Another replica sent a prompt of `prompt_chars` characters to the pod at `address`: the pod's counters
        count its requests too, so the sample is taken over all of them (and comes as many times sooner as there
        are replicas). Counted from the first pick of ours to the pod, whose tally holds the counters then."""
        tally = self._pods.get(address)
        if tally is not None and prompt_chars > 0:
            tally.chars += prompt_chars
            tally.picks += 1

    def forget(self, address: str) -> None:
        self._pods.pop(address, None)
