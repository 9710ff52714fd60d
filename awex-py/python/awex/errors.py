"""The exceptions awex raises; each carries the message of the Rust error that caused it."""

from __future__ import annotations


class AwexError(Exception):
    """Base class of every awex error."""


class LayoutError(AwexError, ValueError):
    """Registered tensors disagree with the rank's layout (name, shape, dtype, contiguity),
    or a rank's description of the pair disagrees with the gateway's."""


class GatewayError(AwexError):
    """The gateway refused a request (``status`` is its HTTP status) or could not be reached
    (``status`` is ``None``). ``queued`` is true when the gateway answered 503 because it could
    not write its state, but had made the change: it is in effect (a started version runs) and
    is written once the disk takes writes again; read the state instead of repeating it."""

    status: int | None = None
    queued: bool = False


class UpdateFailed(AwexError):
    """An update did not commit: ``version`` is the version, ``ranks`` the ranks that did not
    succeed (e.g. ``["inference rank 0/1"]``), and the message the gateway's or rank's reason."""

    version: int | None = None
    ranks: list[str] = []


class Disconnected(AwexError):
    """The pair was disconnected (a rank's ``update`` ends with this when the controller
    disconnects)."""


__all__ = ["AwexError", "LayoutError", "GatewayError", "UpdateFailed", "Disconnected"]
