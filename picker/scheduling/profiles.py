"""Scheduling profiles (filters + weighted scorers + picker) and the classifier that picks one per request.

Long prompts gain most from a cache hit, short chatty ones from an idle pod: one weighting cannot serve
both, so the classifier sends each request to the profile whose weights fit it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.picker import MaxScorePicker
from picker.scheduling.plugins import Filter, Picker, Plugin, PluginFactory, Scorer, default_of, with_params
from picker.scheduling.types import Disaggregation


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(slots=True)
class Profile:
    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    picker: Picker = field(default_factory=MaxScorePicker)

    @property
    def weights(self) -> list[float]:
        return [w.weight for w in self.scorers]

    @property
    def uses_prefix(self) -> bool:
        """Whether any plugin reads the prefix match (else hashing and the index lookup are skipped)."""
        return any(w.scorer.needs_prefix for w in self.scorers)

    def plugins(self) -> list[Plugin]:
        found: list[object] = [*self.filters, *(w.scorer for w in self.scorers), self.picker]
        return [p for p in found if isinstance(p, Plugin)]


class Classifier(Protocol):
    """A profile handler: which profile picks the request's pod and, with prefill/decode disaggregation, which
    one picks a second pod to prefill it (picker/scheduling/disagg.py)."""

    needs_prefix: bool  # reads the prefix match to classify

    @property
    def disaggregates(self) -> bool:
        """Whether it may have another pod prefill a request (whose count ends when the response begins)."""
        ...

    def classify(self, ctx: SchedulingContext) -> str:
        """Name of the profile that picks the destination."""
        ...

    def reason(self, ctx: SchedulingContext) -> str:
        """Why `classify` chooses what it does for this request, in a sentence (Explain only: never routing)."""
        ...

    def prefill_profile(self, ctx: SchedulingContext, decode: Endpoint) -> str | None:
        """The profile that picks a pod to prefill the request for `decode`, or None (prefilled where it runs)."""
        ...

    def decided(self, ctx: SchedulingContext, prefill: Endpoint | None) -> Disaggregation | None:
        """The decision to report (None: this handler does not disaggregate, nothing to count); the prefill pod
        it keeps goes in the cycle state too (`ctx.prefill`: on_picked records the prompt there as well)."""
        ...


class OneStage:
    """What a handler without disaggregation answers: every request is prefilled where it is decoded."""

    @property
    def disaggregates(self) -> bool:
        return False

    def prefill_profile(self, ctx: SchedulingContext, decode: Endpoint) -> str | None:
        return None

    def decided(self, ctx: SchedulingContext, prefill: Endpoint | None) -> Disaggregation | None:
        return None


class SingleProfile(OneStage):
    """Always the same profile (GIE's single-profile-handler)."""

    needs_prefix = False

    def __init__(self, profile: str) -> None:
        self.profile = profile

    def classify(self, ctx: SchedulingContext) -> str:
        return self.profile

    def reason(self, ctx: SchedulingContext) -> str:
        return "the only profile"


# Why RequestClassifier chooses: the branch a request takes (small ints: classify allocates nothing)
_NOTHING_HELD, _SHORT_PREFIX, _LONG_PROMPT, _LONG_PREFIX, _CONTINUATION = range(5)


class RequestClassifier(OneStage, Plugin):
    """context-heavy when the prompt is long or a long prefix is already cached somewhere; else bursty-chat.

    A prompt that is mostly a prefix one pod alone holds (at least `continuation_share` of it and
    `continuation_chars` long) is context-heavy too: it is a conversation's next turn or a document asked again,
    and sending it elsewhere recomputes all of that, which costs more than waiting behind a request or two. Real
    tokenizers put 2.5-4 characters in a token, so a 600-token first turn can match well under
    `long_prefix_chars` and would otherwise move with every small load difference. A prefix several pods hold
    (a popular system prompt) moves between them for free, so its short requests stay bursty-chat.
    """

    type_name = "request-classifier"
    needs_prefix = True

    def __init__(
        self,
        name: str | None = None,
        *,
        long_prompt_chars: int = 8192,
        long_prefix_chars: int = 2048,
        continuation_share: float | None = 0.5,
        continuation_chars: int = 1024,
        context_heavy_profile: str = "context-heavy",
        default_profile: str = "bursty-chat",
    ) -> None:
        super().__init__(name)
        self.long_prompt_chars = long_prompt_chars
        self.long_prefix_chars = long_prefix_chars
        self.continuation_share = continuation_share
        self.continuation_chars = continuation_chars
        self.context_heavy_profile = context_heavy_profile
        self.default_profile = default_profile

    def classify(self, ctx: SchedulingContext) -> str:
        return self.context_heavy_profile if self._branch(ctx) >= _LONG_PROMPT else self.default_profile

    def _branch(self, ctx: SchedulingContext) -> int:
        if len(ctx.request.prompt_text) >= self.long_prompt_chars:
            return _LONG_PROMPT
        if not ctx.matches:
            return _NOTHING_HELD
        held = max(ctx.matches.values())
        matched_chars = held * ctx.block_chars
        if matched_chars >= self.long_prefix_chars:
            return _LONG_PREFIX
        share = self.continuation_share
        if (share is not None and matched_chars >= self.continuation_chars and ctx.covers(held, share)
                and sum(1 for m in ctx.matches.values() if m == held) == 1):
            return _CONTINUATION
        return _SHORT_PREFIX

    def reason(self, ctx: SchedulingContext) -> str:
        branch = self._branch(ctx)
        prompt = len(ctx.request.prompt_text)
        held = max(ctx.matches.values(), default=0) * ctx.block_chars
        if branch == _LONG_PROMPT:
            return f"a long prompt: {prompt} characters (longPromptChars {self.long_prompt_chars})"
        if branch == _NOTHING_HELD:
            return "no pod holds any of this prompt yet: load decides"
        if branch == _LONG_PREFIX:
            return f"a pod holds {held} characters of its prefix (longPrefixChars {self.long_prefix_chars})"
        if branch == _CONTINUATION:
            return (f"one pod alone holds {held} of its {prompt} characters (continuationChars "
                    f"{self.continuation_chars}): elsewhere they would all be computed again")
        return (f"the most any pod holds is {held} of its {prompt} characters (a long prefix is "
                f"{self.long_prefix_chars}): cheap to move, load decides")


class RequestClassifierParams(Section):
    long_prompt_chars: int = Field(default_of(RequestClassifier, "long_prompt_chars"), gt=0)
    long_prefix_chars: int = Field(default_of(RequestClassifier, "long_prefix_chars"), gt=0)
    continuation_share: float | None = Field(default_of(RequestClassifier, "continuation_share"), gt=0, le=1)
    continuation_chars: int = Field(default_of(RequestClassifier, "continuation_chars"), gt=0)
    context_heavy_profile: str = default_of(RequestClassifier, "context_heavy_profile")
    default_profile: str = default_of(RequestClassifier, "default_profile")


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(RequestClassifier.type_name, RequestClassifierParams, with_params(RequestClassifier)),
)
