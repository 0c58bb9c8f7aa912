"""argparse types every command shares: a bad value is a one-line usage error (`argument --pods: must be from 1
to 64, not 0`, exit status 2) before anything starts, never a traceback or a run that goes wrong later."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole_number(least: int = 1, most: int | None = None) -> Callable[[str], int]:
    """A whole number from `least` (to `most`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least or (most is not None and value > most):
            bounds = f"from {least} to {most}" if most is not None else f"at least {least}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {value}")
        return value

    return parse


def positive_number(text: str) -> float:
    """A number above zero (a load, a rate, a time scale)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


port = whole_number(1, 65535)  # a port to listen on or to reach
port_or_off = whole_number(0, 65535)  # 0: not served (or a free port, where the flag says so)


def host_port(text: str) -> str:
    """"host:port" (a name, an IPv4 address or a bracketed IPv6 one), as gRPC targets are written."""
    host, sep, number = text.strip().rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port (e.g. 127.0.0.1:9002)")
    port(number)
    return text.strip()
