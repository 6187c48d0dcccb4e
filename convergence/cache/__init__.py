"""Content-addressed cache of finished runs."""

from __future__ import annotations

from convergence.cache.key import cache_key, code_version, hardware_fingerprint
from convergence.cache.store import CacheError, Claim, RunCache

__all__ = ["CacheError", "Claim", "RunCache", "cache_key", "code_version", "hardware_fingerprint"]
