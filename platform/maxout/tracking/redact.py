"""Credentials never reach params, tags or logs: mask the password of any ``scheme://user:password@host``."""

from __future__ import annotations

import re
from typing import Any

_URI_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")


def redact(value: Any) -> str:
    """``value`` as a string, with the password of every URI inside it replaced by ``***``."""
    return _URI_PASSWORD.sub(r"\1***@", str(value))
