"""Token ids asked of a pod's POST /tokenize: kept, so a request seen before costs the pod nothing; bounded."""

from __future__ import annotations

import json

from picker.core.requests import InferenceRequest, build_request
from picker.prefix.tokens import PodTokenizer, TokenCache
from tests.fake_pod import running_pods


def chat(text: str) -> InferenceRequest:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()
    return build_request({":method": "POST", ":path": "/v1/chat/completions"}, body, request_id="r")


async def test_a_request_tokenized_once_is_not_asked_of_the_pod_again() -> None:
    async with running_pods(1) as (pod,):
        tokenizer = PodTokenizer(timeout=2.0)
        try:
            first = await tokenizer.token_ids(chat("one two three"), lambda: [pod.endpoint])
            again = await tokenizer.token_ids(chat("one two three"), lambda: [pod.endpoint])
            other = await tokenizer.token_ids(chat("four five"), lambda: [pod.endpoint])
        finally:
            await tokenizer.close()
    assert first == again == [3, 3, 5] and other == [4, 4]
    assert pod.tokenized == 2
    assert tokenizer.cache.tokens == 5


async def test_a_pod_that_cannot_tokenize_leaves_nothing_in_the_cache() -> None:
    async with running_pods(1) as (pod,):
        tokenizer = PodTokenizer(timeout=2.0)
        await pod.stop()  # gone: the call fails, the request goes on the approximate index
        try:
            assert await tokenizer.token_ids(chat("one two"), lambda: [pod.endpoint]) is None
        finally:
            await tokenizer.close()
    assert tokenizer.failures == 1 and tokenizer.cache.tokens == 0


def test_the_cache_lets_the_least_recently_used_go_past_its_bound() -> None:
    cache = TokenCache(max_tokens=10)
    a, b, c = (TokenCache.key(x) for x in (b"a", b"b", b"c"))
    cache.put(a, [1] * 4)
    cache.put(b, [2] * 4)
    assert cache.get(a) == [1] * 4  # a used last: b goes first
    cache.put(c, [3] * 4)
    assert cache.get(b) is None and cache.get(a) == [1] * 4 and cache.get(c) == [3] * 4
    assert cache.tokens == 8
    cache.put(TokenCache.key(b"big"), list(range(11)))  # larger than the whole cache: not kept
    assert cache.tokens == 8
