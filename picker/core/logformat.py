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


# Libraries whose DEBUG lines are about their own machinery (gRPC's event loop, asyncio, HTTP clients): at DEBUG
# they stay at INFO, so a debug log shows the picker's decisions; TRACE lets them through too.
TRACE = "TRACE"


def configure_logging(level: str, fmt: str = "text") -> None:
    """The picker's loggers at `level`; every other logger at INFO or above unless `level` is TRACE."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    level = level.upper()
    ours = logging.DEBUG if level == TRACE else logging.getLevelName(level)
    libraries = logging.DEBUG if level == TRACE else max(ours, logging.INFO)
    logging.basicConfig(level=libraries, handlers=[handler], force=True)
    logging.getLogger("picker").setLevel(ours)


def exit_line(message: str, fmt: str = "text") -> str:
    """The last line of a picker that stops on an error, in the log's format (text: the message alone)."""
    if fmt != "json":
        return message
    return JsonFormatter().format(logging.makeLogRecord({"name": "picker", "levelname": "ERROR",
                                                         "levelno": logging.ERROR, "msg": message}))
