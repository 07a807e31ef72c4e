"""Credentials never reach params, tags or logs: mask the password of any ``scheme://user:password@host`` and any
Hugging Face access token (``hf_`` and 30-odd letters and digits; HF_TOKEN's form, also in an error message that
quotes a header or a URL)."""

from __future__ import annotations

import re
from typing import Any

_URI_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}")


def redact(value: Any) -> str:
    """``value`` as a string, with the password of every URI inside it and every Hugging Face token replaced by
    ``***``."""
    return _HF_TOKEN.sub("hf_***", _URI_PASSWORD.sub(r"\1***@", str(value)))
