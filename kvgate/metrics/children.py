"""Labelled metric children resolved once per label values.

`metric.labels(...)` validates and looks up its arguments on every call (about a microsecond, more
than the `inc()` or `observe()` that follows), so the request path keeps the children it has used.
A child is still created only when first used: no zero-valued series appear for label values
that never happened.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *labels: str) -> M:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child
