"""The prefix-hash baseline strategy through real Envoy: a prompt's first 1,000 characters choose its pod."""

from __future__ import annotations

import aiohttp

from picker.supervisor import process_scope, start_backends, start_envoy, start_picker


async def test_prefix_hash_keeps_a_prefix_on_one_pod_and_spreads_prefixes() -> None:
    with process_scope("prefix-hash") as (logdir, started):
        backends = start_backends(3, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=["--strategy", "prefix-hash"])
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
