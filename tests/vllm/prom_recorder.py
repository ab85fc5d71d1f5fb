"""`Recorder`: a Prometheus metric class (Counter, Gauge or Histogram for vLLM's metric types)
that records what `labels(...).inc/set` was given, so a test reads what vLLM exported."""

from __future__ import annotations

from typing import Any, ClassVar


class Recorder:
    made: ClassVar[dict[str, Recorder]] = {}
    """Every metric made since the last `reset`, by name."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], **_: Any) -> None:
        self.labelnames = list(labelnames)
        self.values: dict[tuple[Any, ...], float] = {}
        Recorder.made[name] = self

    @classmethod
    def reset(cls) -> dict[Any, type[Recorder]]:
        """Forgets the metrics made; returns vLLM's `metric_types` mapping onto this class."""
        from prometheus_client import Counter, Gauge, Histogram

        cls.made = {}
        return {Counter: cls, Gauge: cls, Histogram: cls}

    def labels(self, *values: Any) -> Any:
        assert len(values) == len(self.labelnames), (values, self.labelnames)
        metric = self

        class _Child:
            def inc(self, v: float) -> None:
                metric.values[values] = metric.values.get(values, 0) + v

            def set(self, v: float) -> None:
                metric.values[values] = v

        return _Child()
