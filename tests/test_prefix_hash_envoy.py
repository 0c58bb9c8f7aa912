"""The hash baselines through real Envoy: a prompt's first 1,000 characters choose its pod (prefix-hash,
hash-ring; bounded-load too while no pod is past its bound, as here with one request at a time)."""

from __future__ import annotations

import aiohttp
import pytest

from picker_lab.supervisor import process_scope, start_backends, start_envoy, start_picker


@pytest.mark.parametrize("strategy", ["prefix-hash", "hash-ring", "bounded-load"])
async def test_hash_baseline_keeps_a_prefix_on_one_pod_and_spreads_prefixes(strategy: str) -> None:
    with process_scope(strategy) as (logdir, started):
        backends = start_backends(3, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=["--strategy", strategy])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses)
        started.append(envoy.process)
        async with aiohttp.ClientSession() as session:

            async def served_by(system: str, question: str) -> str:
                body = {"model": "tiny", "prompt": f"{system}\n{question}", "max_tokens": 4}
                async with session.post(f"{envoy.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    return str((await response.json())["served_by"])

            systems = [f"You are assistant number {i}. " * 40 for i in range(12)]  # > 1,000 characters each
            home = {s: await served_by(s, "first question") for s in systems}
            assert len(set(home.values())) >= 2  # different prefixes spread
            for s in systems:
                assert await served_by(s, "another question, another day") == home[s]
