"""Metric families kept in plain slotted objects and written in Prometheus' text format by hand
(:mod:`mmserver.ops.metrics` says why): a family's children per label values, their text, and the
same values as prometheus-client metrics for the registry's collector.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value != value:
        return "NaN"
    return repr(float(value))


class CounterChild:
    """One counter series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class GaugeChild:
    """One gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One histogram: a count per bucket (not cumulative; made cumulative when read) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[int], float]:
        counts, total = list(self.counts), self.sum  # one consistent-enough read
        running = 0
        for i, count in enumerate(counts):
            running += count
            counts[i] = running
        return counts, total


Child = TypeVar("Child", CounterChild, GaugeChild, HistogramChild)


class Family(Generic[Child]):
    """A metric family: one child per combination of label values. With no label names it has
    a single child, created at once (Prometheus users expect unlabelled series from the start).

    A *per-model* family (``models`` given) takes the model's name as its first label value.
    With ``labelled`` false it drops that label: every model counts in one series per
    combination of the other labels. With it, a model has series only while it is in
    ``models`` (the live models :class:`Metrics` keeps): a child asked for another name is
    detached (counted nowhere), and :meth:`forget` removes a model's series.
    """

    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        models: set[str] | None = None,
        labelled: bool = True,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.per_model = models is not None
        self.labelled = labelled or not self.per_model
        self._drop = 1 if self.per_model and not self.labelled else 0
        self.labelnames = tuple(labelnames)[self._drop :]
        self._models: set[str] = models if models is not None else set()
        self._children: dict[tuple[str, ...], Child] = {}
        # The rendered ``{label="value",...}`` text of each series, made once.
        self._label_text: dict[tuple[str, ...], str] = {}
        #: The label values of each model's series (labelled per-model families).
        self._by_model: dict[str, list[tuple[str, ...]]] = {}
        if not self.labelnames:
            self.labels()

    def _new_child(self) -> Child:
        raise NotImplementedError

    def labels(self, *values: str) -> Child:
        if self._drop:
            values = values[1:]
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            if self.per_model and self.labelled:
                if values[0] not in self._models:
                    return self._new_child()  # not a live model: no series of its own
                self._by_model.setdefault(values[0], []).append(values)
            child = self._children[values] = self._new_child()
            pairs = ",".join(
                f'{n}="{_escape(v)}"' for n, v in zip(self.labelnames, values, strict=True)
            )
            self._label_text[values] = f"{{{pairs}}}" if pairs else ""
        return child

    def remove(self, *values: str) -> None:
        if self._drop:
            values = values[1:]
        self._removed(self._children.pop(values, None))
        self._label_text.pop(values, None)
        if self.per_model and self.labelled and values:
            keys = self._by_model.get(values[0])
            if keys is not None and values in keys:
                keys.remove(values)
                if not keys:
                    del self._by_model[values[0]]

    def forget(self, model: str) -> None:
        """Remove every series of ``model`` (a labelled per-model family)."""
        for values in self._by_model.pop(model, ()):
            self._removed(self._children.pop(values, None))
            self._label_text.pop(values, None)

    def _removed(self, child: Child | None) -> None:
        """A series left the family (a histogram keeps its counts in the server's total)."""

    def __len__(self) -> int:
        return len(self._children)

    def series(self) -> list[tuple[tuple[str, ...], str, Child]]:
        """A snapshot of the series (safe to take from another thread: one C-level copy)."""
        children = list(self._children.items())
        texts = self._label_text
        return [(values, texts.get(values, ""), child) for values, child in children]

    def render(self, out: list[str]) -> None:
        raise NotImplementedError

    def to_metric(self) -> Metric:
        raise NotImplementedError


class CounterFamily(Family[CounterChild]):
    kind = "counter"

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def render(self, out: list[str]) -> None:
        name = f"{self.name}_total"
        out.append(f"# HELP {name} {self.documentation}\n# TYPE {name} counter\n")
        out.extend(f"{name}{labels} {_number(c.value)}\n" for _, labels, c in self.series())

    def to_metric(self) -> Metric:
        metric = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, _, child in self.series():
            metric.add_metric(list(values), child.value)
        return metric


class GaugeFamily(Family[GaugeChild]):
    kind = "gauge"

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def set(self, value: float) -> None:
        self.labels().set(value)

    def render(self, out: list[str]) -> None:
        name = self.name
        out.append(f"# HELP {name} {self.documentation}\n# TYPE {name} gauge\n")
        out.extend(f"{name}{labels} {_number(c.value)}\n" for _, labels, c in self.series())

    def to_metric(self) -> Metric:
        metric = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, _, child in self.series():
            metric.add_metric(list(values), child.value)
        return metric


class HistogramFamily(Family[HistogramChild]):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: tuple[float, ...],
        *,
        models: set[str] | None = None,
        labelled: bool = True,
    ) -> None:
        self.buckets = buckets
        self._le = [_number(b) for b in buckets] + ["+Inf"]
        #: The counts of the models' series removed so far (labelled per-model families).
        self._retired = HistogramChild(buckets)
        super().__init__(name, documentation, labelnames, models=models, labelled=labelled)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.buckets)

    def _removed(self, child: HistogramChild | None) -> None:
        if child is not None:
            retired = self._retired
            for i, count in enumerate(child.counts):
                retired.counts[i] += count
            retired.sum += child.sum

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def total(self, series: list[tuple[tuple[str, ...], str, HistogramChild]]) -> HistogramChild:
        """The server's histogram: the removed series' counts plus the live ones'."""
        total = HistogramChild(self.buckets)
        total.counts = list(self._retired.counts)
        total.sum = self._retired.sum
        for _, _, child in series:
            for i, count in enumerate(child.counts):
                total.counts[i] += count
            total.sum += child.sum
        return total

    def series(self) -> list[tuple[tuple[str, ...], str, HistogramChild]]:
        """The series, led by the server's total when the family is labelled per model."""
        series = super().series()
        if self.per_model and self.labelled:
            series.insert(0, ((), "", self.total(series)))
        return series

    def render(self, out: list[str]) -> None:
        name = self.name
        out.append(f"# HELP {name} {self.documentation}\n# TYPE {name} histogram\n")
        bucket = f"{name}_bucket{{"
        for _, labels, child in self.series():
            counts, total = child.cumulative()
            inner = f",{labels[1:-1]}" if labels else ""
            out.extend(
                f'{bucket}le="{le}"{inner}}} {count}.0\n'
                for le, count in zip(self._le, counts, strict=True)
            )
            out.append(
                f"{name}_count{labels} {counts[-1]}.0\n{name}_sum{labels} {_number(total)}\n"
            )

    def to_metric(self) -> Metric:
        metric = HistogramMetricFamily(self.name, self.documentation)
        for values, _, child in self.series():
            counts, total = child.cumulative()
            buckets = [(le, float(c)) for le, c in zip(self._le, counts, strict=True)]
            labels = dict(zip(self.labelnames, values, strict=False))
            metric.samples += [
                *(
                    Sample(f"{self.name}_bucket", {**labels, "le": le}, value)
                    for le, value in buckets
                ),
                Sample(f"{self.name}_count", labels, buckets[-1][1]),
                Sample(f"{self.name}_sum", labels, total),
            ]
        return metric


class FamiliesCollector(Collector):
    def __init__(self, families: list[Family[Any]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.to_metric()
