"""The timeline of a planned step: what each stage did when, as spans on one time axis; a text picture and a chart.

Each shard records its spans on its own wall clock; on one host the stages share that clock, across hosts
they agree as far as the hosts' clocks do (NTP keeps them within a millisecond or so).
"""

from __future__ import annotations

import dataclasses
import os

from client_sdk import charts
from shardtrain.v1 import shard_pb2

KINDS = {shard_pb2.WORK_KIND_FORWARD: "forward", shard_pb2.WORK_KIND_BACKWARD: "backward",
         shard_pb2.WORK_KIND_WEIGHT: "weight", shard_pb2.WORK_KIND_ALLREDUCE: "allreduce",
         shard_pb2.WORK_KIND_OPTIMIZER: "optimizer"}
_COMPUTE = ("forward", "backward", "weight")  # a stage's own work: what is not its bubble
_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "weight": "tab:olive", "allreduce": "tab:purple",
            "optimizer": "tab:green"}
_MARKS = {"forward": "F", "backward": "B", "weight": "W", "allreduce": "A", "optimizer": "O"}


@dataclasses.dataclass(frozen=True)
class Span:
    """One span of a stage's work; times in seconds from the step's first span on any stage."""

    replica: int
    stage: int
    kind: str          # forward, backward, weight (of a split backward), allreduce or optimizer
    microbatch: int    # of a forward, backward or weight
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Every stage's spans in one planned step (`model.timeline()`), in order per stage."""

    spans: tuple[Span, ...]

    @classmethod
    def from_stats(cls, stats: list[shard_pb2.StageStats]) -> Timeline:
        origin = min((span.start for stage in stats for span in stage.spans), default=0.0)
        return cls(tuple(Span(stage.replica, stage.stage, KINDS.get(span.kind, "other"), span.microbatch,
                              span.start - origin, span.end - origin)
                         for stage in sorted(stats, key=lambda s: (s.replica, s.stage)) for span in stage.spans))

    def lanes(self) -> dict[tuple[int, int], list[Span]]:
        """(replica, stage) -> its spans, in time order."""
        lanes: dict[tuple[int, int], list[Span]] = {}
        for span in self.spans:
            lanes.setdefault((span.replica, span.stage), []).append(span)
        return {lane: sorted(spans, key=lambda s: s.start) for lane, spans in sorted(lanes.items())}

    @property
    def makespan(self) -> float:
        """From the first compute span starting to the last one ending, on any stage."""
        work = [span for span in self.spans if span.kind in _COMPUTE]
        return max(s.end for s in work) - min(s.start for s in work) if work else 0.0

    def bubble(self) -> float:
        """The mean over stages of the fraction of the makespan a stage spent outside its own compute."""
        lanes = self.lanes()
        if not lanes or not self.makespan:
            return 0.0
        busy = [sum(s.end - s.start for s in spans if s.kind in _COMPUTE) for spans in lanes.values()]
        return 1 - sum(busy) / len(busy) / self.makespan

    def text(self, width: int = 100) -> str:
        """One row per stage: F forward, B backward, W weight gradient, A all-reduce, O optimizer step, . idle;
        each character a 1/width of the step, marked by what filled most of it."""
        lanes = self.lanes()
        end = max((s.end for s in self.spans), default=0.0)
        if not lanes or end <= 0:
            return "(no planned step recorded)"
        rows = []
        for (replica, stage), spans in lanes.items():
            cells = []
            for column in range(width):
                low, high = end * column / width, end * (column + 1) / width
                filled = {}
                for span in spans:
                    overlap = min(high, span.end) - max(low, span.start)
                    if overlap > 0:
                        filled[span.kind] = filled.get(span.kind, 0.0) + overlap
                kind = max(filled, key=filled.get) if filled else None
                cells.append(_MARKS.get(kind, "?") if kind and filled[kind] >= (high - low) / 2 else ".")
            rows.append(f"replica {replica} stage {stage:<3d}|{''.join(cells)}|")
        rows.append(f"{'':18}0{'':{width - 1}}{end * 1e3:.0f} ms")
        return "\n".join(rows)

    def plot(self, path: str | os.PathLike | None = None):
        """A matplotlib Gantt chart: one row per stage, a bar per span (colour by kind), milliseconds on the
        x axis; saved as PNG when given a path. Needs matplotlib (pip install 'shardtrain[plots]')."""
        lanes = list(self.lanes())
        figure, axes = charts.pyplot().subplots(figsize=(10, 1 + 0.5 * len(lanes)))
        labelled = set()
        for span in self.spans:
            row = lanes.index((span.replica, span.stage))
            label = None if span.kind in labelled else span.kind
            labelled.add(span.kind)
            axes.barh(row, (span.end - span.start) * 1e3, left=span.start * 1e3, height=0.8, label=label,
                      color=_COLOURS.get(span.kind, "grey"), edgecolor="white", linewidth=0.5)
        axes.set_yticks(range(len(lanes)), [f"replica {r} stage {s}" for r, s in lanes])
        axes.invert_yaxis()  # stage 0 on top
        axes.set_xlabel("ms")
        axes.set_title(f"bubble {self.bubble():.3f}")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside the bars
        return charts.finished(figure, path)

    def __str__(self) -> str:
        return self.text()
