"""Plugin contracts: filters narrow the candidates, scorers grade them in [0,1], pickers rank them.

Stateful plugins (session stickiness, cold spreading) learn from the final pick through `on_picked`, from the
picks of other replicas sharing the prefix index through `on_peer_picked`, and forget a departed endpoint through
`on_endpoint_removed`, like the prefix index.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from picker.core.replicas import ReplicaView
from picker.core.schema import Section
from picker.endpoints.saturation import SaturationThresholds
from picker.endpoints.state import Endpoint
from picker.prefix.hashing import PrefixHasher
from picker.prefix.index import CacheRoom, PrefixIndex
from picker.prefix.precise import PrecisePrefix
from picker.scheduling.context import SchedulingContext


@dataclass(frozen=True, slots=True)
class PeerPick:
    """What another picker replica routed, as the shared prefix index carries it."""

    address: str
    prompt_tokens: float  # the peer's prompt, counted at `chars_per_token` as ours are
    session_id: str = ""
    prompt_chars: int = 0  # the prompt's length as the peer sent it
    keys: Sequence[int] = ()  # the prompt's chained block keys (our block width: the replicas share a config)


class Plugin:
    """Base of every configured plugin: a name (for config refs and Explain) and no-op lifecycle hooks."""

    type_name = "plugin"
    needs_prefix = False  # True for plugins that read the prefix match (hashing is skipped when none does)

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.type_name

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        """The request described by `ctx` went to `endpoint`."""
        return None

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """Another replica picked `pick.address`: learn from it as from our own picks, so replicas do not herd."""
        return None

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        return None


@runtime_checkable
class Filter(Protocol):
    name: str
    type_name: str

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """Survivors of `candidates` (may raise RequestError when the request cannot be served at all)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    name: str
    type_name: str
    needs_prefix: bool  # reads the prefix match (when no scorer does, hashing and the lookup are skipped)

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        """One score in [0,1] per candidate, same order; higher is better."""
        ...


@runtime_checkable
class SessionMemory(Protocol):
    """A plugin that remembers which pod each session went to last. The scheduler asks it once per request and
    writes the answer into the cycle state (`session_pod`), so other plugins can defer to a known session."""

    def session_pod(self, session: str) -> str | None:
        """The pod `session` (IndexKey.session) went to last; None when not remembered."""
        ...


@runtime_checkable
class Picker(Protocol):
    name: str
    type_name: str

    def pick(self, totals: Sequence[float]) -> list[int]:
        """Candidate indices ranked best first (at most the picker's count), from their weighted totals."""
        ...


def min_max_inverse(values: Sequence[float]) -> list[float]:
    """GIE-style normalisation: the lowest value scores 1, the highest 0, all equal -> 1."""
    lo = min(values)
    hi = max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


class PredictionObserver(Protocol):
    """Where a predicting plugin reports how its predictions compare with what the pods measured (the picker's
    Prometheus metrics), so users can see whether to trust them."""

    def observe_prediction(self, endpoint: Endpoint, predicted_s: float, observed_s: float) -> None:
        """Mean predicted and pod-measured TTFT of `endpoint`'s requests over one scrape interval."""
        ...


class PluginTimer(Protocol):
    """Where the scheduler reports how long each plugin took (the picker's Prometheus metrics). Timing every
    request would tax the hot path, so the timer says which requests to time."""

    def plugin_timing_due(self) -> bool:
        """Whether to time the plugins of the request being scheduled."""
        ...

    def observe_plugin(self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float) -> None:
        ...


@dataclass(frozen=True, slots=True)
class PluginDeps:
    """What the scheduler's builder hands every plugin factory: shared settings, never another plugin."""

    rng: random.Random | None = None  # tie-breaks (a seeded one makes runs reproducible)
    base_models: tuple[str, ...] = ()  # `models.base`: request models that are no LoRA adapter
    adapters: tuple[str, ...] = ()  # `models.adapters`
    saturation: SaturationThresholds = field(default_factory=SaturationThresholds)  # the admission section's
    observer: PredictionObserver | None = None  # prediction vs measurement (None: not reported)
    cache_room: CacheRoom | None = None  # the prefix index's view of each pod's cache room (None: not known)
    # What prefix sources read: the index (a shared one with Redis/Valkey), how prompts are cut into its blocks,
    # and the pods' KV events (None: not subscribed)
    prefix_index: PrefixIndex | None = None
    hasher: PrefixHasher | None = None
    precise: PrecisePrefix | None = None
    # this replica among the replicas sharing the pool: its place, what they learned (None: it routes alone)
    replicas: ReplicaView | None = None


class NoParams(Section):
    """A plugin without parameters: any key given is an error."""


P = TypeVar("P", bound=Section)


@dataclass(frozen=True, slots=True)
class PluginFactory(Generic[P]):
    """How a plugin `type` is built from config: its own typed, strictly decoded parameters plus the deps."""

    type_name: str
    params: type[P]
    build: Callable[[str, P, PluginDeps], Plugin]
    # Built with its default parameters when the config lists no plugin of this type and this says so for the
    # deps at hand (the prefix sources every picker runs); None: only when listed
    implied: Callable[[PluginDeps], bool] | None = None


def no_params(cls: Callable[[str], Plugin]) -> Callable[[str, NoParams, PluginDeps], Plugin]:
    def build(name: str, params: NoParams, deps: PluginDeps) -> Plugin:
        return cls(name)
    return build


def default_of(cls: type[Plugin], argument: str) -> Any:
    """A plugin constructor's default for `argument`: what its parameter section declares as the YAML default, so
    each default value is written once, in the constructor (tests/test_defaults_once.py keeps it so)."""
    default = inspect.signature(cls).parameters[argument].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{cls.__name__}({argument}) has no default to declare")
    return default


def with_params(cls: Callable[..., Plugin]) -> Callable[[str, Section, PluginDeps], Plugin]:
    """Parameters whose names are the constructor's keyword arguments, nothing from the deps."""
    def build(name: str, params: Section, deps: PluginDeps) -> Plugin:
        kwargs: dict[str, Any] = params.model_dump()
        return cls(name, **kwargs)
    return build
