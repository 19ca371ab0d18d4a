"""Errors a user can hit: each message says what went wrong and what to do."""

from __future__ import annotations


class DgrError(Exception):
    """An expected failure. The CLI prints it as one line and exits non-zero."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def one_line(self) -> str:
        text = str(self).replace("\n", " ")
        return f"{text} ({self.hint})" if self.hint else text
