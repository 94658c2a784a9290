"""A stage's backward in two passes, for zero-bubble schedules: the input pass computes only the gradients the
stage before waits for (its input and the residuals it received), the weight pass later computes the parameters'.

The input pass records the gradient arriving at each autograd node where a parameter's branch joins the path from
the outputs to the inputs; the weight pass starts from those nodes, so it runs only the parameters' branches
and no part of the backward is computed twice. Parameters whose branch never joins that path (a stage whose input
takes no gradient, a term that depends on weights alone) get theirs from the outputs in the weight pass.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(tensor: torch.Tensor) -> Node | None:
    """The autograd node a gradient of `tensor` enters: its grad_fn, or a leaf's gradient accumulator."""
    if tensor.grad_fn is not None or not tensor.requires_grad:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # accumulators exist once something uses them


class _Junction:
    """Parameters whose branches join the input path at `nodes`, and the gradients that arrived at those."""

    def __init__(self, nodes: set[Node], parameters: set[Node]):
        self.nodes = list(nodes)
        self.parameters = parameters
        self.grads: list[tuple | None] = [None] * len(self.nodes)

    def recorder(self, i: int):
        def record(grad_outputs: tuple) -> None:
            self.grads[i] = grad_outputs
        return record


class WeightPass:
    """The rest of a backward whose input pass ran: accumulates every parameter's gradient into `.grad` (so that
    post-accumulate-grad hooks fire as in a whole backward)."""

    def __init__(self, roots: list[torch.Tensor], grads: list[torch.Tensor], junctions: list[_Junction],
                 uncovered: list[torch.Tensor], tensor_of: dict[Node, torch.Tensor]):
        self._roots, self._grads = roots, grads
        self._junctions, self._uncovered, self._tensor_of = junctions, uncovered, tensor_of

    def run(self) -> None:
        """Computes the parameters' gradients; the graph is released afterwards."""
        ready = [j for j in self._junctions if all(grad is not None for grad in j.grads)]
        missed = [self._tensor_of[node] for j in self._junctions if j not in ready for node in j.parameters]
        from_roots = self._uncovered + missed
        if from_roots:
            torch.autograd.backward(self._roots, self._grads, inputs=from_roots, retain_graph=True)
        for junction in ready:
            _from_junction(junction, self._tensor_of)
        self._roots = self._grads = self._junctions = []


def _from_junction(junction: _Junction, tensor_of: dict[Node, torch.Tensor]) -> None:
    edges, seeds = [], []
    for node, grads in zip(junction.nodes, junction.grads):
        for i, grad in enumerate(grads):
            if grad is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(grad)
    if not edges:
        return
    # A junction node below another would also receive the upper one's gradient: pin each to what it got.
    pins = [node.register_prehook(lambda _, saved=grads: saved)
            for node, grads in zip(junction.nodes, junction.grads)] if len(junction.nodes) > 1 else []
    try:
        torch.autograd.backward(edges, seeds, inputs=[tensor_of[node] for node in junction.parameters],
                                retain_graph=True)
    finally:
        for pin in pins:
            pin.remove()


def input_pass(roots: list[torch.Tensor], grads: list[torch.Tensor], leaves: Sequence[torch.Tensor | None],
               parameters: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """Backpropagates from `roots` (seeded with `grads`) to `leaves` only: their gradients (None where a leaf takes
    none), and the weight pass that completes the backward."""
    tensor_of = {grad_node(p): p for p in parameters if p.requires_grad}
    wanted = [i for i, leaf in enumerate(leaves) if leaf is not None and leaf.requires_grad]
    leaf_grads: list[torch.Tensor | None] = [None] * len(leaves)
    if not roots or not wanted:
        return leaf_grads, WeightPass(roots, grads, [], list(tensor_of.values()), tensor_of)
    consumers = _consumers([grad_node(root) for root in roots])
    junctions = _junctions([grad_node(leaves[i]) for i in wanted], list(tensor_of), consumers)
    hooks = [node.register_prehook(junction.recorder(i)) for junction in junctions
             for i, node in enumerate(junction.nodes)]
    try:
        computed = torch.autograd.grad(roots, [leaves[i] for i in wanted], grads, retain_graph=True,
                                       allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    for i, grad in zip(wanted, computed):
        leaf_grads[i] = grad
    covered = {node for junction in junctions for node in junction.parameters}
    uncovered = [tensor for node, tensor in tensor_of.items() if node not in covered]
    return leaf_grads, WeightPass(roots, grads, junctions, uncovered, tensor_of)


def _consumers(roots: list[Node | None]) -> dict[Node, list[Node]]:
    """For every node reachable from `roots`, the nodes that pass it a gradient (the graph's edges reversed)."""
    consumers: dict[Node, list[Node]] = collections.defaultdict(list)
    queue = collections.deque(node for node in dict.fromkeys(roots) if node is not None)
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _upward(starts: list[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` toward the roots without entering `stop`, and the `stop` nodes met."""
    reached, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for consumer in consumers.get(queue.popleft(), ()):
            if consumer in stop:
                met.add(consumer)
            elif consumer not in reached:
                reached.add(consumer)
                queue.append(consumer)
    return reached, met


def _junctions(inputs: list[Node], parameters: list[Node], consumers: dict[Node, list[Node]]) -> list[_Junction]:
    """Groups the parameters by where their branches join the input path (the nodes between roots and inputs);
    parameters sharing a junction node end up in one group."""
    on_path, _ = _upward(inputs, consumers, set())
    by_node: dict[Node, _Junction] = {}
    for parameter in parameters:
        _, met = _upward([parameter], consumers, on_path)
        if not met:
            continue
        joined = {id(by_node[node]): by_node[node] for node in met if node in by_node}
        junction = _Junction(met, {parameter})
        for other in joined.values():
            junction = _Junction(set(junction.nodes) | set(other.nodes), junction.parameters | other.parameters)
        for node in junction.nodes:
            by_node[node] = junction
    return list({id(j): j for j in by_node.values()}.values())
