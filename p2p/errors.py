"""Typed errors of the wire layer. Every message says what went wrong and, where it helps, what to do."""
from __future__ import annotations


class WireError(Exception):
    """Base class of every error raised by blocktrain.p2p."""


# -- addresses ------------------------------------------------------------------------------
class AddressError(WireError, ValueError):
    """A multiaddr given by the user is malformed or of an unsupported kind."""


# -- identity -------------------------------------------------------------------------------
class IdentityError(WireError):
    """The identity file cannot be read, written or used."""


class IdentityInUseError(IdentityError):
    """Another live process holds the lock on this identity (``holder``: its pid, as its lock file says)."""

    def __init__(self, message: str, holder: str = "unknown"):
        super().__init__(message)
        self.holder = holder


# -- records / discovery --------------------------------------------------------------------
class RecordError(WireError, ValueError):
    """A manifest or announcement is invalid."""


class RunNotFoundError(WireError):
    """No manifest is published for the run."""


class ConfigMismatchError(WireError):
    """This node's config hash differs from the run's."""


class ManifestConflictError(WireError):
    """Several manifests with different config hashes are published under one run id."""


class DiscoveryError(WireError):
    """The DHT could not be started, joined or queried."""


# -- rpc ------------------------------------------------------------------------------------
class HopError(WireError):
    """Base class of RPC failures."""


class HopRequestError(HopError, ValueError):
    """A request or response violates the hop limits (raised locally, nothing was sent or accepted)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.reason = message


class RemoteHopError(HopError):
    """The remote peer refused or failed the call; ``code`` is machine-readable, ``reason`` human-readable."""

    def __init__(self, peer_id: str, code: str, reason: str):
        super().__init__(f"peer {peer_id} answered {code}: {reason}")
        self.peer_id = peer_id
        self.code = code
        self.reason = reason


class StreamTruncatedError(RemoteHopError):
    """An answer stream ended, without any error, before it was complete (code ``truncated``).

    hivemind cannot tell a stream the peer finished from one whose libp2p stream was reset: p2pd
    closes our end of the stream the same way in both cases, and hivemind's reader takes the close
    as the end. A reset happens when the connection between the two daemons drops (yamux closes a
    connection whose peer daemon leaves a keepalive ping unanswered for 10 s: a daemon stopped or
    starved on a loaded machine) or the peer's handler went away. Distinct from
    :class:`HopTimeoutError`: the client was still willing to wait."""

    def __init__(self, peer_id: str, reason: str):
        super().__init__(peer_id, "truncated", reason)


class HopTimeoutError(HopError, TimeoutError):
    """The remote peer did not answer within the client's timeout."""


def drop_tracebacks(e: BaseException | None) -> None:
    """Forget the tracebacks of ``e`` and of every exception chained to it (``__cause__``, ``__context__``).

    For an expected failure that is handled, not logged: on Python 3.11 an exception raised through
    ``asyncio.wait_for`` (or any awaited future) sits in a reference cycle (the waiting frame -> its future
    -> the exception -> its traceback -> that frame), and the cycle holds every frame of the traceback,
    with their locals, until the cycle collector runs. For a stage that fails micro-batches downstream those
    locals are the micro-batches' activations: without this they pile up between collections (docs/records/s28)."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        todo += [x.__cause__, x.__context__]
