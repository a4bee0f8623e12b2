"""Content hashes: the ids of records, store keys and settings."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def content_hash(obj: Any, n: int = 16) -> str:
    """Stable hash of a JSON-able value (key order and whitespace do not matter)."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]
