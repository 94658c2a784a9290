"""Batch norms under micro-batches: running statistics advance once per step, from the whole batch's statistics.

As torchgpipe's deferred batch norm: each micro-batch is still normalised with its own statistics, as it would be
alone, but a stage does not update running_mean and running_var per micro-batch (momentum applied m times a step,
num_batches_tracked counted m times). It sums each channel's values and squares over the step's micro-batches and
applies one update, from the whole batch's mean and unbiased variance, when the step's last forward has run: the
running statistics equal one full-batch step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_BATCH_NORM = torch.ops.aten.batch_norm.default


@dataclass
class _Norm:
    """One training-mode batch norm of a stage: its running statistics and what the step's micro-batches summed."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    momentum: float
    total: torch.Tensor | None = None    # per channel, float64
    squares: torch.Tensor | None = None
    count: int = 0

    def observe(self, x: torch.Tensor) -> None:
        """Adds a micro-batch's per-channel sums (input [N, C, ...])."""
        with torch.no_grad():
            values = x.detach().to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1)
            total, squares = values.sum(1), (values * values).sum(1)
            self.total = total if self.total is None else self.total + total
            self.squares = squares if self.squares is None else self.squares + squares
            self.count += values.shape[1]

    def commit(self) -> None:
        if self.count == 0:
            return
        with torch.no_grad():
            mean = self.total / self.count
            variance = (self.squares / self.count - mean * mean).clamp_min(0) * (self.count / max(self.count - 1, 1))
            self.running_mean.mul_(1 - self.momentum).add_(mean.to(self.running_mean.dtype), alpha=self.momentum)
            self.running_var.mul_(1 - self.momentum).add_(variance.to(self.running_var.dtype), alpha=self.momentum)
        self.total, self.squares, self.count = None, None, 0


@dataclass
class DeferredNorms:
    """The training-mode batch norms of a stage's layers, rewritten to defer their running statistics."""

    norms: list[_Norm] = field(default_factory=list)
    counters: list[torch.Tensor] = field(default_factory=list)  # num_batches_tracked
    observed: bool = False
    replaying: bool = False  # a forward run again in backward (recomputation): its statistics were counted

    def install(self, module: torch.fx.GraphModule) -> None:
        """Rewrites `module`'s graph: its batch norms update no running statistics, each passes its input to a
        _Norm instead, and `num_batches_tracked += 1` is left to commit()."""
        graph, changed = module.graph, False
        for node in list(graph.nodes):
            if _is_counter_update(node):
                self.counters.append(module.get_buffer(node.args[0].target))
                graph.erase_node(node)
                changed = True
            elif _is_training_batch_norm(node):
                norm = _Norm(module.get_buffer(node.args[3].target), module.get_buffer(node.args[4].target),
                             float(node.args[6]))
                self.norms.append(norm)
                node.args = (*node.args[:3], None, None, *node.args[5:])
                with graph.inserting_before(node):
                    graph.call_function(self._observer(norm), (node.args[0],))
                changed = True
        if changed:
            graph.lint()
            module.recompile()

    def _observer(self, norm: _Norm):
        def observe_batch_norm_input(x: torch.Tensor) -> None:
            if not self.replaying:
                norm.observe(x)
                self.observed = True
        return observe_batch_norm_input

    def paused(self) -> _Paused:
        """Forwards run again (recomputation) count nothing: their micro-batches were counted the first time. The
        context may be entered again (a split backward recomputes a layer in each of its passes)."""
        return _Paused(self)

    def start_step(self) -> None:
        """Forgets what an unfinished step summed."""
        for norm in self.norms:
            norm.total, norm.squares, norm.count = None, None, 0
        self.observed = False

    def commit(self) -> None:
        """Applies the step's one update of every running statistic."""
        if not self.observed:
            return
        for norm in self.norms:
            norm.commit()
        with torch.no_grad():
            for counter in self.counters:
                counter.add_(1)
        self.observed = False


class _Paused:
    def __init__(self, norms: DeferredNorms):
        self._norms = norms

    def __enter__(self) -> None:
        self._norms.replaying = True

    def __exit__(self, *exc) -> None:
        self._norms.replaying = False


def _is_training_batch_norm(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is _BATCH_NORM and len(node.args) >= 7
            and node.args[5] is True and isinstance(node.args[6], float)
            and all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in node.args[3:5]))


def _is_counter_update(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.aten.add_.Tensor and not node.users
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr"
            and node.args[0].target.endswith("num_batches_tracked"))
