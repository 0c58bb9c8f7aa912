"""Prefill/decode disaggregation: pods with roles, a decode pick first, then a prefill pick when it pays.

A pod's role is its `llm-d.ai/role` label (Kubernetes pod labels, `labels:` in the endpoints file), with the
reference's values. The `disagg-profile-handler` runs the decode profile (its pick is the destination: the decode
pod, or the sidecar in front of it), then asks its prefill decider whether the prompt's part the decode pod does not
hold is long enough to pay for a transfer; if so it runs the prefill profile, whose pick goes to the sidecar in the
`x-prefiller-host-port` header. No prefill pod left after filtering: decode-only, never a failed request. The
reference's names and keys are accepted (`pd-profile-handler`, its flat keys, `prefix-based-pd-decider`'s
`nonCachedTokens` / `promptTokens`, in tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import Field, field_validator, model_validator

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import NoParams, Plugin, PluginDeps, PluginFactory, default_of, no_params
from picker.scheduling.types import Disaggregation

ROLE_LABEL = "llm-d.ai/role"
DECODE_ROLES = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})
PREFILL_ROLES = frozenset({"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"})

def decodes(endpoint: Endpoint) -> bool:
    """A pod without a role label decodes (a pool that does not split prefill from decode has none)."""
    role = endpoint.labels.get(ROLE_LABEL)
    return role is None or role in DECODE_ROLES


def prefills(endpoint: Endpoint) -> bool:
    """Only a pod labelled with a prefilling role takes remote prefills."""
    return endpoint.labels.get(ROLE_LABEL) in PREFILL_ROLES


class DecodeFilter(Plugin):
    """Pods that decode: a decoding role, or no role label at all."""

    type_name = "decode-filter"

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if decodes(e)]


class PrefillFilter(Plugin):
    """Pods labelled to prefill (`prefill`, `prefill-decode`, ...); unlabelled pods never prefill for another."""

    type_name = "prefill-filter"

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if prefills(e)]


@runtime_checkable
class PrefillDecider(Protocol):
    """Whether a request whose decode pod is `decode` should be prefilled on another pod."""

    name: str
    needs_prefix: bool

    def disaggregate(self, ctx: SchedulingContext, decode: Endpoint) -> bool: ...


class PrefixBasedPdDecider(Plugin):
    """Disaggregate when the prompt's tokens the decode pod does not hold reach `non_cached_tokens` (0: never) and
    the prompt has at least `prompt_tokens` (0: any length). A short uncached tail costs less to prefill where the
    request decodes than to move; what the decode pod holds is the prefix match of the request's cycle state."""

    type_name = "prefix-based-pd-decider"
    needs_prefix = True

    def __init__(self, name: str | None = None, *, non_cached_tokens: int = 0, prompt_tokens: int = 0) -> None:
        super().__init__(name)
        self.non_cached_tokens = non_cached_tokens
        self.prompt_tokens = prompt_tokens

    def disaggregate(self, ctx: SchedulingContext, decode: Endpoint) -> bool:
        if self.non_cached_tokens <= 0:
            return False
        request = ctx.request
        ids = request.token_ids
        tokens = len(ids) if ids else int(ctx.prompt_tokens())
        if tokens < self.prompt_tokens or tokens < self.non_cached_tokens:
            return False
        held = int(ctx.tokens(ctx.matches.get(decode.address, 0) * ctx.block_chars))
        return tokens - held >= self.non_cached_tokens


class AlwaysDisaggPdDecider(Plugin):
    """Every request is prefilled remotely (when a prefill pod is there): for tests and for pools built so."""

    type_name = "always-disagg-pd-decider"

    def disaggregate(self, ctx: SchedulingContext, decode: Endpoint) -> bool:
        return True


class DisaggProfileHandler(Plugin):
    """Runs the decode profile; then, when the prefill decider says so, the prefill profile (a profile handler:
    the scheduler asks `classify` for the profile that picks the destination, `prefill_profile` for the second)."""

    type_name = "disagg-profile-handler"

    def __init__(self, name: str | None = None, *, decode_profile: str = "decode", prefill_profile: str = "prefill",
                 decider: str | None = None, max_prefill_queue_tokens: int | None = 8192) -> None:
        super().__init__(name)
        # A prefill pod with this many prompt tokens of ours still to prefill is backlogged: the request is
        # prefilled where it decodes rather than queued behind them (None: always the prefill pod)
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.decode_profile = decode_profile
        self.prefill_profile_name = prefill_profile
        self.decider_name = decider  # None: decode-only (the reference's handler without deciders.prefill)
        self.decider: PrefillDecider | None = None  # bound by the scheduler's builder from `decider_name`

    def bind(self, plugins: Mapping[str, Plugin]) -> str | None:
        """Find the decider among the configured plugins; the problem, if any (the builder names the key)."""
        if self.decider_name is None:
            return None
        found = plugins.get(self.decider_name)
        if found is None:
            return f"unknown prefill decider {self.decider_name!r} (not in scheduling.plugins)"
        if not isinstance(found, PrefillDecider):
            return f"{self.decider_name!r} is not a prefill decider"
        self.decider = found
        self.needs_prefix = found.needs_prefix  # the scheduler hashes the prompt only if someone reads the match
        return None

    @property
    def disaggregates(self) -> bool:
        return self.decider_name is not None  # none: decode-only

    def profiles(self) -> tuple[str, ...]:
        return (self.decode_profile, self.prefill_profile_name) if self.decider_name else (self.decode_profile,)

    def classify(self, ctx: SchedulingContext) -> str:
        return self.decode_profile

    def reason(self, ctx: SchedulingContext) -> str:
        return "P/D: every request's own pod is picked by the decode profile"

    def prefill_profile(self, ctx: SchedulingContext, decode: Endpoint) -> str | None:
        decider = self.decider
        if decider is None or not decider.disaggregate(ctx, decode):
            return None
        return self.prefill_profile_name

    def decided(self, ctx: SchedulingContext, prefill: Endpoint | None) -> Disaggregation | None:
        limit = self.max_prefill_queue_tokens
        if prefill is not None and limit is not None and prefill.in_flight_tokens >= limit:
            prefill = None  # backlogged: a local prefill starts sooner than a place in its queue
        ctx.prefill = prefill  # the prefill pod computes the prompt too: on_picked records it there as well
        return Disaggregation(self.name, self.type_name, prefill)


class PdProfileHandler(DisaggProfileHandler):
    """The reference's deprecated name for the same handler (flat keys, a decider it cannot run without)."""

    type_name = "pd-profile-handler"


class DisaggPdHeadersHandler(Plugin):
    """The reference's separate header plugin (`disagg-headers-handler`, `prefill-header-handler`): the header
    is set wherever a prefill pod was chosen, so naming it changes nothing; its profile name must agree."""

    type_name = "disagg-headers-handler"

    def __init__(self, name: str | None = None, *, prefill_profile: str = "prefill") -> None:
        super().__init__(name)
        self.prefill_profile = prefill_profile


class PrefillHeaderHandler(DisaggPdHeadersHandler):
    type_name = "prefill-header-handler"


def _not_encode(value: str | None) -> str | None:
    if value is not None:
        raise ValueError("encode disaggregation is not implemented")
    return value


class _Stages(Section):
    decode: str = default_of(DisaggProfileHandler, "decode_profile")
    prefill: str = default_of(DisaggProfileHandler, "prefill_profile")
    encode: str | None = None  # named only: without an encode decider no encode stage runs


class _Deciders(Section):
    prefill: str | None = None
    encode: str | None = None

    _no_encode = field_validator("encode")(_not_encode)


class DisaggProfileHandlerParams(Section):
    """The reference's nested keys, or its deprecated flat ones (not both)."""

    stage_order: Literal["decode-first"] = "decode-first"
    profiles: _Stages | None = None
    deciders: _Deciders | None = None
    decode_profile: str | None = None
    prefill_profile: str | None = None
    prefill_decider_plugin_name: str | None = None
    decider_plugin_name: str | None = None
    # ours: a prefill pod this backlogged (prompt tokens we sent it still prefilling) is passed over (null: never)
    max_prefill_queue_tokens: int | None = Field(default_of(DisaggProfileHandler, "max_prefill_queue_tokens"), gt=0)

    @model_validator(mode="after")
    def _one_format(self) -> DisaggProfileHandlerParams:
        flat = (self.decode_profile, self.prefill_profile, self.prefill_decider_plugin_name, self.decider_plugin_name)
        if (self.profiles is not None or self.deciders is not None) and any(v is not None for v in flat):
            raise ValueError("use profiles/deciders or the flat decodeProfile/prefillProfile/deciderPluginName "
                             "keys, not both")
        return self

    def handler_args(self) -> dict[str, Any]:
        stages = self.profiles or _Stages()
        decider = self.deciders.prefill if self.deciders is not None else None
        return {"decode_profile": self.decode_profile or stages.decode,
                "prefill_profile": self.prefill_profile or stages.prefill,
                "decider": self.prefill_decider_plugin_name or self.decider_plugin_name or decider,
                "max_prefill_queue_tokens": self.max_prefill_queue_tokens}


class PdProfileHandlerParams(Section):
    """The deprecated `pd-profile-handler`: flat keys, and a decider it cannot run without."""

    decode_profile: str = default_of(DisaggProfileHandler, "decode_profile")
    prefill_profile: str = default_of(DisaggProfileHandler, "prefill_profile")
    decider_plugin_name: str = PrefixBasedPdDecider.type_name
    primary_port: int = 0
    prefix_match_info_producer_name: str | None = None  # our prefix match is in the cycle state: nothing to name
    prefix_plugin_type: str | None = None  # declared by the reference, never read
    prefix_plugin_name: str | None = None
    max_prefill_queue_tokens: int | None = Field(default_of(DisaggProfileHandler, "max_prefill_queue_tokens"), gt=0)

    @field_validator("primary_port")
    @classmethod
    def _no_primary_port(cls, value: int) -> int:
        if value:
            raise ValueError("data-parallel rank ports (x-data-parallel-host-port) are not implemented: leave it 0")
        return value


class PrefixBasedPdDeciderParams(Section):
    non_cached_tokens: int = Field(default_of(PrefixBasedPdDecider, "non_cached_tokens"), ge=0)
    prompt_tokens: int = Field(default_of(PrefixBasedPdDecider, "prompt_tokens"), ge=0)


class HeadersHandlerParams(Section):
    prefill_profile: str = default_of(DisaggPdHeadersHandler, "prefill_profile")
    encode_profile: str | None = None  # named only, as in _Stages


def _disagg(name: str, p: DisaggProfileHandlerParams, deps: PluginDeps) -> Plugin:
    return DisaggProfileHandler(name, **p.handler_args())


def _pd(name: str, p: PdProfileHandlerParams, deps: PluginDeps) -> Plugin:
    return PdProfileHandler(name, decode_profile=p.decode_profile, prefill_profile=p.prefill_profile,
                            decider=p.decider_plugin_name, max_prefill_queue_tokens=p.max_prefill_queue_tokens)


def _prefix_decider(name: str, p: PrefixBasedPdDeciderParams, deps: PluginDeps) -> Plugin:
    return PrefixBasedPdDecider(name, non_cached_tokens=p.non_cached_tokens, prompt_tokens=p.prompt_tokens)


def _headers(cls: type[DisaggPdHeadersHandler]) -> PluginFactory[HeadersHandlerParams]:
    def build(name: str, p: HeadersHandlerParams, deps: PluginDeps) -> Plugin:
        return cls(name, prefill_profile=p.prefill_profile)
    return PluginFactory(cls.type_name, HeadersHandlerParams, build)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(DecodeFilter.type_name, NoParams, no_params(DecodeFilter)),
    PluginFactory(PrefillFilter.type_name, NoParams, no_params(PrefillFilter)),
    PluginFactory(PrefixBasedPdDecider.type_name, PrefixBasedPdDeciderParams, _prefix_decider),
    PluginFactory(AlwaysDisaggPdDecider.type_name, NoParams, no_params(AlwaysDisaggPdDecider)),
    PluginFactory(DisaggProfileHandler.type_name, DisaggProfileHandlerParams, _disagg),
    PluginFactory(PdProfileHandler.type_name, PdProfileHandlerParams, _pd),
    _headers(DisaggPdHeadersHandler),
    _headers(PrefillHeaderHandler),
)
