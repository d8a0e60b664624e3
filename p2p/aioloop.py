"""An asyncio event loop in a daemon thread, for callers that are threads (the node) but need async RPC."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "in_event_loop", "quiet_cancelled"]

T = TypeVar("T")
logger = logging.getLogger(__name__)


def in_event_loop() -> bool:
    """True if the calling thread is running an asyncio loop (so blocking calls are forbidden)."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def quiet_cancelled(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a CancelledError raised in a callback is a task cancelled on
    purpose (at a stop), not an error; anything else goes to asyncio's default handler.

    Why: Python 3.11's ``StreamReaderProtocol`` (3.11.7 here) calls ``task.exception()`` in the
    done-callback of a connection handler's task without checking ``task.cancelled()``; when a node
    stops, hivemind's stream handlers on its loops are cancelled and each printed a CancelledError
    traceback ("Exception in callback ... connection_made") into the node's log at a clean exit."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug("a callback saw a cancelled task: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


class LoopThread:
    """Owns one event loop running forever in a daemon thread.

    ``run(coro)`` blocks the caller until the coroutine finishes on the loop; ``submit(coro)`` returns
    a concurrent Future. Objects bound to a loop (hivemind ``P2P`` replicas, servers, clients) must be
    created and used through the same LoopThread.
    """

    def __init__(self, name: str = "bt-p2p-loop"):
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(quiet_cancelled)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()
        # drain what is left so transports close cleanly
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("LoopThread is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (must not be called from the loop itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop: await the coroutine instead")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> "LoopThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
