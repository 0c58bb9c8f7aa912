"""Static endpoint sources: `--endpoints host:port,...` and an `--endpoints-file` (YAML/JSON) reloaded on change.

An entry is an IP address or a host name with its port. Envoy sends a request to the IP the picker names, so a
name (a docker-compose service, a headless Service, `localhost`) is resolved to every address it has, and
resolved again every few seconds (as Envoy's STRICT_DNS clusters are): a model server that restarts on another
address is followed, and a name that does not resolve yet (a container still starting) joins once it does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from picker.core.schema import load_yaml
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint, is_ip, parse_host_port

log = logging.getLogger(__name__)

VALID_FORM = ('each entry is "host:port" (an IP or a name), or {address: "host:port", name: ..., labels: {key: '
              'value}}; the whole a list, or {endpoints: [...]}')
RESOLVE_EVERY = 5.0  # seconds between resolutions of the names (Envoy's STRICT_DNS default)

Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """One configured endpoint: an IP (one endpoint) or a name (one endpoint per address it resolves to)."""

    host: str
    port: int
    name: str = ""
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str, name: str = "", labels: dict[str, str] | None = None) -> EndpointSpec:
        host, port = parse_host_port(text)
        return cls(host, port, name, tuple(sorted((labels or {}).items())))

    @property
    def named(self) -> bool:
        return not is_ip(self.host)

    def endpoints(self, addresses: Sequence[str]) -> list[Endpoint]:
        """The endpoints of this entry, given the addresses its name resolved to (its IP for an address)."""
        labels = dict(self.labels)
        if not self.named:
            return [Endpoint.from_address(_joined(self.host, self.port), self.name, labels)]
        base = self.name or f"{self.host}:{self.port}"
        return [Endpoint.from_address(_joined(ip, self.port), base if len(addresses) == 1 else f"{base}/{ip}", labels)
                for ip in addresses]


def _joined(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def parse_endpoint_list(text: str) -> list[EndpointSpec]:
    """"host:port,host:port" → entries; ValueError naming the bad one."""
    return [EndpointSpec.parse(part) for part in text.split(",") if part.strip()]


def load_endpoints_file(path: Path) -> list[EndpointSpec]:
    """A YAML or JSON list of "host:port" strings or {address, name, labels} objects (also {endpoints: [...]});
    ValueError (ConfigError for broken YAML) naming the file and, for a wrong entry, the valid form."""
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    else:
        data = load_yaml(text, str(path))
    if isinstance(data, dict):
        data = data.get("endpoints", [])
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of endpoints ({VALID_FORM})")
    specs: list[EndpointSpec] = []
    for item in data:
        if isinstance(item, str):
            specs.append(_entry(path, item))
        elif isinstance(item, dict) and isinstance(item.get("address"), str):
            labels = item.get("labels") or {}
            if not isinstance(labels, dict):
                raise ValueError(f"{path}: labels of {item['address']} must be a mapping")
            specs.append(_entry(path, item["address"], str(item.get("name") or ""),
                                {str(k): str(v) for k, v in labels.items()}))
        else:
            raise ValueError(f"{path}: bad endpoint entry {item!r}: {VALID_FORM}")
    return specs


def _entry(path: Path, address: str, name: str = "", labels: dict[str, str] | None = None) -> EndpointSpec:
    try:
        return EndpointSpec.parse(address, name, labels)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


async def resolve_name(host: str, port: int) -> list[str]:
    """Every IPv4 address `host` resolves to, or its IPv6 ones when it has none (Envoy's V4_PREFERRED: `localhost`
    is 127.0.0.1, not also ::1), from the system resolver off the event loop, in its order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET]
    return list(dict.fromkeys(v4 or [str(info[4][0]) for info in infos]))


class StaticEndpoints:
    """The pool from configured entries: addresses as given, names as last resolved. `set_specs` applies a new list
    at once (names resolved before keep their addresses), `resolve` asks the resolver again; `run` resolves every
    RESOLVE_EVERY seconds while any entry is a name. A name that stops resolving keeps its last addresses (the
    scraper finds out whether they still answer)."""

    def __init__(self, pool: EndpointPool, resolver: Resolver = resolve_name, every: float = RESOLVE_EVERY) -> None:
        self.pool = pool
        self.resolver = resolver
        self.every = every
        self.specs: list[EndpointSpec] = []
        self.resolved: dict[tuple[str, int], list[str]] = {}
        self._failing: set[tuple[str, int]] = set()  # names whose last resolution failed (said once)

    def set_specs(self, specs: list[EndpointSpec]) -> tuple[list[Endpoint], list[Endpoint]]:
        self.specs = specs
        return self._apply()

    def _apply(self) -> tuple[list[Endpoint], list[Endpoint]]:
        endpoints: list[Endpoint] = []
        for spec in self.specs:
            addresses = self.resolved.get((spec.host, spec.port), []) if spec.named else [spec.host]
            endpoints += spec.endpoints(addresses)
        return self.pool.set_endpoints(endpoints)

    async def resolve(self) -> None:
        """Resolve every name once, then apply what changed."""
        names = list(dict.fromkeys((s.host, s.port) for s in self.specs if s.named))
        changed = False
        for key in names:
            try:
                addresses = await self.resolver(*key)
            except OSError as exc:
                if key not in self._failing:
                    kept = self.resolved.get(key, [])
                    log.warning("endpoint %s:%d does not resolve (%s); %s", key[0], key[1], exc,
                                f"keeping {', '.join(kept)}" if kept else "it joins the pool once it does")
                    self._failing.add(key)
                continue
            if key in self._failing:
                self._failing.discard(key)
                log.info("endpoint %s:%d resolves again: %s", key[0], key[1], ", ".join(addresses))
            if addresses and addresses != self.resolved.get(key):
                self.resolved[key] = addresses
                changed = True
        for key in [k for k in self.resolved if k not in names]:
            del self.resolved[key]
        if changed:
            added, removed = self._apply()
            if added or removed:
                log.info("endpoints resolved: %d endpoints (+%d, -%d)", len(self.pool), len(added), len(removed))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            if any(spec.named for spec in self.specs):
                await self.resolve()


class EndpointsFileWatcher:
    """Polls the file's mtime and size; a changed, valid file replaces the entries, an invalid one is logged and
    ignored (the last good set keeps serving)."""

    def __init__(self, path: Path, source: StaticEndpoints, interval: float = 1.0) -> None:
        self.path = path
        self.source = source
        self.interval = interval
        self._signature: tuple[float, int] | None = None

    def load_now(self) -> bool:
        """Reload if the file changed; True when the entries were replaced."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            log.warning("endpoints file %s is missing; keeping %d endpoints", self.path, len(self.source.pool))
            return False
        signature = (stat.st_mtime, stat.st_size)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            specs = load_endpoints_file(self.path)
        except ValueError as exc:  # checked at start-up (exit 2): only a later edit can be wrong here
            log.error("endpoints file %s is invalid, keeping the last good set of %d endpoints: %s", self.path,
                      len(self.source.pool), exc)
            return False
        added, removed = self.source.set_specs(specs)
        log.info("endpoints file reloaded: %d endpoints (+%d, -%d)", len(self.source.pool), len(added), len(removed))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self.load_now() and any(spec.named for spec in self.source.specs):
                await self.source.resolve()
