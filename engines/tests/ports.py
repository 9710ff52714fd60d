"""Loopback ports for servers and rendezvous the engine tests start (one helper for every suite)."""

from __future__ import annotations

import random
import socket

#: the ports :func:`free_port` handed out in this process (never the same one twice)
_GIVEN: set[int] = set()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (``bind(0)`` and outgoing connections take ports from it)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port no one listens on, for a server started later.

    The port comes from *below* the kernel's ephemeral range: a ``bind(0)`` port lies inside it,
    and between the pick and the server's own bind any ``bind(0)`` or outgoing connection of
    another process may take it (on 2026-12-03 a live SGLang server's uvicorn found its port
    taken: "[Errno 98] ... address already in use", 30 s after the pick, while its TP ranks
    opened their gloo sockets). Ports outside the range are taken only by an explicit bind."""
    low, high = ephemeral_range()
    # the span beside the ephemeral range, below it unless that is smaller than above it
    below, above = (max(1024, low - 16384), low), (high + 1, min(65536, high + 1 + 16384))
    start, end = max(below, above, key=lambda r: r[1] - r[0])
    if end - start < 256:
        with socket.socket() as s:  # a kernel whose ephemeral range covers nearly every port
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(256):
        port = rng.randrange(start, end)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{start}, {end}) after 256 tries")
