"""Trainer backends: how a JobSpec becomes a command, and where its metrics land."""

from __future__ import annotations

from convergence.backends.base import Backend, get_backend

__all__ = ["Backend", "get_backend"]
