"""Graceful stop on SIGTERM / SIGINT: the loop finishes its step, saves, and returns.

`stop_requests()` installs handlers that only record the signal; the training loop polls
`StopRequest.signal` after each step. A second signal of the same kind gets the previous handler
(the default: SIGINT raises KeyboardInterrupt, SIGTERM ends the process), so a stuck run can still
be killed. Handlers can only be installed from the main thread; elsewhere nothing is installed.

Example:
    >>> with stop_requests() as stop:  # doctest: +SKIP
    ...     for step in range(steps):
    ...         train_one_step()
    ...         if stop.signal is not None:
    ...             save(); break
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The first stop signal received (a `signal.Signals`), or None."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.signal is None:
            self.signal = signal.Signals(signum)
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    @property
    def name(self) -> str:
        """`SIGTERM`, `SIGINT`, or '' when no signal came."""
        return self.signal.name if self.signal is not None else ""


@contextlib.contextmanager
def stop_requests(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Records `signals` in the yielded `StopRequest` while the block runs; restores handlers after."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    for sig in signals:
        request._previous[sig] = signal.signal(sig, request._handle)
    try:
        yield request
    finally:
        for sig, handler in request._previous.items():
            signal.signal(sig, handler)
