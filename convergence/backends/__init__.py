"""Trainer backends: how a JobSpec becomes a command, and where its metrics land."""

from __future__ import annotations

from convergence.backends.base import Backend, Capabilities, CodeIdentity
from convergence.backends.registry import backend_names, get_backend

__all__ = ["Backend", "Capabilities", "CodeIdentity", "backend_names", "get_backend"]
