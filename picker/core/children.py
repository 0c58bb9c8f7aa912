"""What every command that starts child processes says when one of them dies: the child, its exit status, why
(the last line it logged) and where its log is, never a traceback."""

from __future__ import annotations

from pathlib import Path


class ProcessExited(RuntimeError):
    """A child exited while it was awaited: what it was, its exit status, the last lines of its log and, as the
    one-line cause, the last of them (a child says why it stops as it goes)."""

    def __init__(self, what: str, returncode: int, log_tail: str = "", log_path: Path | None = None) -> None:
        lines = [line for line in log_tail.splitlines() if line.strip()]
        self.what, self.returncode, self.log_tail, self.log_path = what, returncode, "\n".join(lines), log_path
        self.cause = lines[-1].strip() if lines else ""
        super().__init__(f"{what}: process exited with {returncode}" + (f": {self.cause}" if self.cause else ""))

    def describe(self) -> str:
        """Several lines for a person: the child and its status and cause, then the last lines of its log."""
        text = f"{self.what} exited with status {self.returncode} while starting"
        text += f": {self.cause}" if self.cause else ""
        if self.log_tail:
            where = f" ({self.log_path})" if self.log_path is not None else ""
            text += f"\n  its last log lines{where}:\n" + "\n".join(f"    {line}" for line in self.log_tail.splitlines())
        return text
