"""For tests only: a gateway inside this process.

``start_gateway()`` serves an awex gateway on a free ``127.0.0.1`` port on a background runtime
and returns its URL; it lives until the process exits. Real deployments run ``awex-cli serve``.
"""

from __future__ import annotations

from . import _awex


def start_gateway(token: str | None = None) -> str:
    """Starts an in-process gateway on loopback (tests only) and returns its URL."""
    return _awex.start_gateway(token)


__all__ = ["start_gateway"]
