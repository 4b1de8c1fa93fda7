"""At most one log line per interval for something any client or engine can cause at will.

A flood of malformed requests or impossible engine numbers must not flood the log: the first
occurrence is logged, the rest within `interval_s` are counted and their number told with the next
line logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class LogThrottle:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._next = 0.0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self._interval_s
        suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            message += " (and %d more like it since the last such line)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
