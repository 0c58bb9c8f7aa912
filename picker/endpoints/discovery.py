"""Static endpoint sources: `--endpoints ip:port,...` and an `--endpoints-file` (YAML/JSON) reloaded on change."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from picker.core.schema import load_yaml
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)


def parse_endpoint_list(text: str) -> list[Endpoint]:
    """"ip:port,ip:port" → endpoints; ValueError naming the bad entry."""
    return [Endpoint.from_address(part) for part in text.split(",") if part.strip()]


VALID_FORM = ('each entry is "ip:port", or {address: "ip:port", name: ..., labels: {key: value}}; the whole a '
              'list, or {endpoints: [...]}')


def load_endpoints_file(path: Path) -> list[Endpoint]:
    """A YAML or JSON list of "ip:port" strings or {address, name, labels} objects (also {endpoints: [...]});
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
    endpoints: list[Endpoint] = []
    for item in data:
        if isinstance(item, str):
            endpoints.append(_entry(path, item))
        elif isinstance(item, dict) and isinstance(item.get("address"), str):
            labels = item.get("labels") or {}
            if not isinstance(labels, dict):
                raise ValueError(f"{path}: labels of {item['address']} must be a mapping")
            endpoints.append(_entry(path, item["address"], str(item.get("name") or ""),
                                    {str(k): str(v) for k, v in labels.items()}))
        else:
            raise ValueError(f"{path}: bad endpoint entry {item!r}: {VALID_FORM}")
    return endpoints


def _entry(path: Path, address: str, name: str = "", labels: dict[str, str] | None = None) -> Endpoint:
    try:
        return Endpoint.from_address(address, name, labels or {})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


class EndpointsFileWatcher:
    """Polls the file's mtime and size; a changed, valid file replaces the pool, an invalid one is logged and
    ignored (the last good set keeps serving)."""

    def __init__(self, path: Path, pool: EndpointPool, interval: float = 1.0) -> None:
        self.path = path
        self.pool = pool
        self.interval = interval
        self._signature: tuple[float, int] | None = None

    def load_now(self) -> bool:
        """Reload if the file changed; True when the pool was replaced."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            log.warning("endpoints file %s is missing; keeping %d endpoints", self.path, len(self.pool))
            return False
        signature = (stat.st_mtime, stat.st_size)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            endpoints = load_endpoints_file(self.path)
        except ValueError as exc:  # checked at start-up (exit 2): only a later edit can be wrong here
            log.error("endpoints file %s is invalid, keeping the last good set of %d endpoints: %s", self.path,
                      len(self.pool), exc)
            return False
        added, removed = self.pool.set_endpoints(endpoints)
        log.info("endpoints file reloaded: %d endpoints (+%d, -%d)", len(self.pool), len(added), len(removed))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.load_now()
