"""Content hashes: the ids of records, store keys and settings."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> str:
    """The JSON text content hashes are taken of: sorted keys, no whitespace, non-ASCII as is."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def content_hash(obj: Any, n: int = 16) -> str:
    """Stable hash of a JSON-able value (key order and whitespace do not matter)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:n]


def ids_json(ids: list[int]) -> str:
    """Token ids as JSON at a third of json.dumps' cost: the very text `canonical_json` gives them, which the request
    key hashes (and the store keeps)."""
    return "[" + ",".join(map(str, ids)) + "]"
