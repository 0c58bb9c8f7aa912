"""Per-request facts every plugin reads, computed once: prefix keys, index matches, the adapter asked for.

This is the request's cycle state (GIE's CycleState): built by `schedule`, returned in the result and handed
back to `on_picked`, so nothing about one request is kept in the shared scheduler between the two calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from picker.core.requests import CHARS_PER_TOKEN, InferenceRequest
from picker.endpoints.state import Endpoint
from picker.prefix.hashing import DEFAULT_BLOCK_CHARS


class Detail(Protocol):
    """What a plugin computed for one candidate, for Explain: named figures (not scores: any range)."""

    def explain(self) -> dict[str, float]: ...


@dataclass(slots=True)
class SchedulingContext:
    """What the scheduler learnt about one request before filters and scorers run."""

    request: InferenceRequest
    now: float
    model: str  # the name the pod sees (after a rewrite): also the LoRA adapter name when it is one
    keys: list[int] = field(default_factory=list)
    session: str = ""  # the request's x-session-id as remembered and shared (IndexKey.session); "" without one
    # the pod the session's last request went to, from the profile's session memory (None: no session, or new)
    session_pod: str | None = None
    block_chars: int = DEFAULT_BLOCK_CHARS
    # how many characters make a token where the prompt's token ids are not known (prefixCache.charsPerToken):
    # plugins count a prompt's tokens with it, as the director counts them in flight
    chars_per_token: int = CHARS_PER_TOKEN
    matches: dict[str, int] = field(default_factory=dict)  # address -> matched blocks (index view)
    matched: list[int] = field(default_factory=list)  # aligned with the candidates being scored
    # the pod the prompt's opening (HOME_BLOCKS blocks) last went to: where a prefix that no pod holds any more
    # comes back to (None: never seen, or too short to tell)
    home: str | None = None
    precise_keys: list[int] = field(default_factory=list)  # the prompt's token-block keys (precise prefix mode)
    precise_pods: frozenset[str] = frozenset()  # the pods whose match came from their KV events
    # address -> tokens of the match held only by an offloading tier (host memory, storage); None: no pod has any
    precise_offloaded: dict[str, int] | None = None
    # With a TTFT objective (request.slo_ttft_s): whether some candidate is predicted to meet it (None: not
    # predicted); the director sheds a sheddable request none can serve in time
    slo_attainable: bool | None = None
    # the candidates a sample was drawn from when only a sample of them is scored (candidate-sample-filter); 0: all
    # are scored. Plugins that weigh a pod's share of the traffic count shares of the whole set
    sampled_from: int = 0
    prefill: Endpoint | None = None  # with P/D: the pod that prefills the prompt (it caches it too)
    # plugin name -> what that plugin computed for this request and reads again at `on_picked` (None until a
    # plugin keeps something: most requests need no dict)
    state: dict[str, object] | None = None
    # plugin name -> one Detail per scored candidate (aligned with them), read only by Explain and traces
    details: dict[str, Sequence[Detail]] | None = None

    def note(self, plugin: str, per_candidate: Sequence[Detail]) -> None:
        if self.details is None:
            self.details = {}
        self.details[plugin] = per_candidate

    def tokens(self, chars: float) -> float:
        """`chars` characters of prompt in tokens."""
        return chars / self.chars_per_token

    def prompt_tokens(self) -> float:
        """The whole prompt in tokens."""
        return self.tokens(len(self.request.prompt_text))

    def covers(self, blocks: int, share: float) -> bool:
        """Whether `blocks` matched blocks are at least `share` of the prompt (in characters)."""
        return blocks * self.block_chars >= share * len(self.request.prompt_text)

    def uncached_tokens(self, address: str) -> float:
        """The prompt's tokens the index does not place on the pod at `address`: what it would prefill there."""
        uncached = len(self.request.prompt_text) - self.matches.get(address, 0) * self.block_chars
        return self.tokens(uncached) if uncached > 0 else 0.0

    def start_profile(self) -> None:
        """A profile's run begins: what a profile's own plugins set for its run starts over (a sample filter of
        this profile sets `sampled_from` again)."""
        self.sampled_from = 0

    @contextlib.contextmanager
    def side_run(self) -> Iterator[None]:
        """A second profile's run for the same request (P/D's prefill pick): what its plugins compute and keep is
        dropped after it, so what the request's own pick learns from stays its own profile's."""
        kept = self.matched, self.details, self.state
        self.details, self.state = None, None
        try:
            yield
        finally:
            self.matched, self.details, self.state = kept

    def align(self, candidates: Sequence[Endpoint]) -> None:
        """Refresh `matched` for this candidate list (after filtering)."""
        matches = self.matches
        if not matches:
            self.matched = [0] * len(candidates)
        else:
            get = matches.get
            self.matched = [get(e.address, 0) for e in candidates]


def effective_model(request: InferenceRequest) -> str:
    """The model name the pod will see: the rewrite target when there is one."""
    return request.target_model or request.model
