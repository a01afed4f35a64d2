"""The one error a refused KV import raises."""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 8, 8, 80, 80, 40


def _brief(x: Any) -> str:
    """A value as it fits in a log line: a hostile span's 16 MiB string is not repeated in full."""
    if isinstance(x, str):
        return x if len(x) <= 200 else f"{x[:200]}... ({len(x)} characters)"
    return _REPR.repr(x)


class InvalidKVImport(ValueError):
    """A span refused before anything was written: `field` names what was wrong, `expected` and
    `received` say how. The receiver is exactly as it was."""

    def __init__(self, field: str, expected: Any, received: Any) -> None:
        self.field, self.expected, self.received = field, expected, received
        super().__init__(f"invalid KV import: {field}: expected {_brief(expected)}, received {_brief(received)}")
