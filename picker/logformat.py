"""Log lines as text (default) or one JSON object per line (`--log-format json`, or the reference picker's
`--zap-encoder json`), for log pipelines that parse fields rather than lines."""

from __future__ import annotations

import json
import logging

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """ts (seconds since the epoch), level, logger, msg, and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                                    "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
