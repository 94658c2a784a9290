"""The floor: the PyTorch-shaped loop over 3 stage processes in the leanest Python that keeps its rules.

    python -m bench.floor [--batch 32] [--steps 300] [--rounds 4] [--threads 1]

What the loop of bench/train_step.py does, less everything a service needs: each stage is one
process with one thread, blocking on its Unix sockets (one socket pair per pair of parties,
made before the processes start); an item is a fixed binary header and the tensor's raw bytes;
nothing is checked, named, retried or reported. The stages run the seed model's layers as plain
PyTorch modules (client_sdk.LayerList, split where the coordinator would: shardtrain.partition)
under the same rules as shardtrain's loop:
- a forward waits until the optimizer step sent before it has been applied on its stage;
- the optimizer step enters at the first stage and goes down; each stage passes it on once its
  own backward is over, then applies it;
- a residual goes straight from its producer to its consumer, and its gradient straight back;
- the driver (this process) sends the input, waits for the output, computes the loss and its
  gradient, sends that into the last stage and the optimizer step into the first, and goes on
  without waiting for the backward to finish (the first stage says when it has, as in shardtrain).

What it is for: on a given host, how fast a 3-process pipeline of this model can step at all.
Where shardtrain's loop is slower than the floor, the difference is the framework's own cost
(framing, checks, shared-memory bookkeeping, the event loop, the SDK's autograd hook-up); where the
floor itself is slower than one process, it is the host's (hand-offs between processes, cores
shared by four of them).
`check()` trains the floor and one process from the same weights and compares every parameter, so
the figure is the time of the real training, not of messages alone.

It is a floor where each step's fixed costs dominate (small batches). With big batches the work
dominates, and the floor's stages all run on one thread count (--threads).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as Cluster.local's shards and bench.train_step

import torch  # noqa: E402 - after the OpenMP setting, which is read when torch loads
import torch.nn.functional as F  # noqa: E402

from bench.rpc_baseline import _make_data  # noqa: E402
from client_sdk import LayerList  # noqa: E402
from client_sdk.processes import reap  # noqa: E402
from client_sdk.seed_models import TEST_RESIDUAL_SMALL  # noqa: E402
from shardtrain.partition import balanced  # noqa: E402
from shardtrain.residuals import route, run_chain  # noqa: E402

LR = 3e-3
STAGES = 3
DRIVER = -1
# kind, step, residual index (or -1), ndim, four dims, data bytes
_HEADER = struct.Struct("<bii b4i q")
FORWARD, BACKWARD, RESIDUAL, RESIDUAL_GRADIENT, STEP, OUTPUT, DONE, STATE, THREADS, STOP = range(10)


def _send(sock: socket.socket, kind: int, step: int, tensor: torch.Tensor | None = None, index: int = -1) -> None:
    if tensor is None:
        sock.sendall(_HEADER.pack(kind, step, index, 0, 0, 0, 0, 0, 0))
        return
    tensor = tensor.detach().contiguous()
    dims = list(tensor.shape) + [0] * (4 - tensor.dim())
    data = memoryview(tensor.numpy()).cast("B")
    sock.sendmsg([_HEADER.pack(kind, step, index, tensor.dim(), *dims, len(data)), data])


def _read_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            raise EOFError("the other end closed its socket")
        got += count
    return buffer


def _receive(sock: socket.socket) -> tuple[int, int, int, torch.Tensor | None]:
    kind, step, index, ndim, *rest = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    dims, size = rest[:4], rest[4]
    if size == 0 and ndim == 0:
        return kind, step, index, None
    tensor = torch.frombuffer(_read_exactly(sock, size), dtype=torch.float32) if size else torch.empty(0)
    return kind, step, index, tensor.view(*dims[:ndim])


def split_of(model: LayerList, stages: int) -> list[tuple[int, int]]:
    """Balanced by parameter count, as the coordinator splits a model it is given without split points."""
    return list(balanced([sum(p.numel() for p in layer.parameters()) for layer in model.children()], stages))


def _stage_main(stage: int, stages: int, sockets: dict[int, socket.socket], adam: dict) -> None:
    """One stage: its layers of the model, and the loop over its sockets until STOP. `adam`: Adam's
    keyword arguments besides the learning rate."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LayerList(TEST_RESIDUAL_SMALL)  # the whole model from the seed's weights; this stage runs its slice
    split = split_of(model, stages)
    first, end = split[stage]
    layers, wirings = model._adapters[first:end], model.wirings[first:end]
    optimizer = torch.optim.Adam([p for layer in layers for p in layer.parameters()], lr=LR, **adam)
    routes = route(model.wirings, split)  # which residuals cross stages, as the coordinator routes them
    names = sorted({name for crossing in routes for name in crossing.outgoing})  # a residual's index on the wire
    incoming, outgoing = routes[stage].incoming, routes[stage].outgoing
    previous = sockets[stage - 1] if stage > 0 else sockets[DRIVER]
    following = sockets[stage + 1] if stage + 1 < len(split) else sockets[DRIVER]

    forwards, gradients, steps, state_asked = [], {}, [], []
    residuals, residual_grads, in_flight = {}, {}, {}
    applied, finished = 0, -1  # optimizer steps applied here; the last step whose backward is over here
    selector = selectors.DefaultSelector()
    for sock in sockets.values():
        selector.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            kind, step, index, tensor = _receive(key.fileobj)
            if kind == STOP:
                return
            if kind == THREADS:
                torch.set_num_threads(index)
            elif kind == STATE:
                state_asked.append(index)  # answered once this many optimizer steps are applied here
            elif kind == FORWARD:
                forwards.append((step, index, tensor))
            elif kind == RESIDUAL:
                residuals[(step, names[index])] = tensor
            elif kind == RESIDUAL_GRADIENT:
                residual_grads.setdefault((step, names[index]), []).append(tensor)
            elif kind == BACKWARD:
                gradients[step] = tensor
            elif kind == STEP:
                steps.append(step)
            # Backwards whose gradients are all here.
            for step in sorted(gradients):
                if any(len(residual_grads.get((step, name), ())) < len(consumers)
                       for name, consumers in outgoing.items()):
                    break
                x, output, produced, leaves = in_flight.pop(step)
                pairs = [(output, gradients.pop(step))]
                for name in outgoing:
                    received = [g for g in residual_grads.pop((step, name)) if g is not None]
                    pairs.append((produced[name], sum(received) if received else None))
                pairs = [(root, grad) for root, grad in pairs if grad is not None]
                torch.autograd.backward([root for root, _ in pairs], [grad for _, grad in pairs])
                for name, leaf in leaves.items():
                    _send(sockets[incoming[name]], RESIDUAL_GRADIENT, step, leaf.grad, names.index(name))
                if stage > 0:
                    _send(previous, BACKWARD, step, x.grad)
                else:
                    _send(previous, DONE, step)
                finished = step
            # Optimizer steps whose backward is over here: passed on, then applied.
            while steps and steps[0] <= finished:
                step = steps.pop(0)
                if stage + 1 < len(split):
                    _send(following, STEP, step)
                optimizer.step()
                optimizer.zero_grad()
                applied += 1
            # Forwards whose optimizer step is applied and whose residuals are here.
            while forwards and forwards[0][1] <= applied and all((forwards[0][0], n) in residuals for n in incoming):
                step, after, x = forwards.pop(0)  # after: optimizer steps to apply first, passed on down
                x.requires_grad_(stage > 0)
                leaves = {name: residuals.pop((step, name)).requires_grad_(True) for name in incoming}
                saved = dict(leaves)
                output = run_chain(layers, wirings, x, saved)
                _send(following, OUTPUT if stage + 1 == len(split) else FORWARD, step, output, after)
                for name, consumers in outgoing.items():
                    for consumer in consumers:
                        _send(sockets[consumer], RESIDUAL, step, saved[name], names.index(name))
                in_flight[step] = (x, output, {name: saved[name] for name in outgoing}, leaves)
            while state_asked and state_asked[0] <= applied:
                state_asked.pop(0)
                keys = list(model.state_dict())
                for name, value in model.state_dict().items():
                    if first <= int(name.split(".")[0]) < end:
                        _send(sockets[DRIVER], STATE, -1, value, keys.index(name))
                _send(sockets[DRIVER], DONE, -1)


class Floor:
    """The seed model's stage processes (`python -m bench.floor --stage i`) and this process's sockets to them."""

    def __init__(self, stages: int = STAGES, adam: dict | None = None):
        """`adam`: keyword arguments for every stage's Adam besides the learning rate (say {"fused": True})."""
        torch.manual_seed(0)
        model = LayerList(TEST_RESIDUAL_SMALL)
        self.split = split_of(model, stages)
        parties = [DRIVER, *range(stages)]
        ends: dict[int, dict[int, socket.socket]] = {party: {} for party in parties}
        for i, a in enumerate(parties):
            for b in parties[i + 1:]:
                ends[a][b], ends[b][a] = socket.socketpair(socket.AF_UNIX)
        self._first, self._last = ends[DRIVER][0], ends[DRIVER][stages - 1]
        self._sockets = ends[DRIVER]
        self._step = 0
        self._key_order = list(model.state_dict())
        self._processes: list[subprocess.Popen] = []
        root = pathlib.Path(__file__).resolve().parent.parent
        try:
            for stage in range(stages):
                fds = {party: sock.fileno() for party, sock in ends[stage].items()}
                self._processes.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.floor", "--stage", str(stage), "--stages", str(stages),
                     "--sockets", json.dumps(fds), "--adam", json.dumps(adam or {})],
                    cwd=root, pass_fds=list(fds.values())))
        except BaseException:
            self.close()
            raise
        finally:
            for stage in range(stages):
                for sock in ends[stage].values():
                    sock.close()  # each child holds its own copy

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One step of the loop: forward, loss, backward sent, optimizer step sent."""
        step, self._step = self._step, self._step + 1
        _send(self._first, FORWARD, step, x, index=step)  # index: optimizer steps to apply first
        _, _, _, output = _receive(self._last)
        prediction = output.requires_grad_(True)
        F.mse_loss(prediction, y).backward()
        _send(self._last, BACKWARD, step, prediction.grad)
        _send(self._first, STEP, step)
        self._drain_done()

    def _drain_done(self) -> None:
        """Reads the first stage's DONE items that have arrived, without waiting for more."""
        while select.select([self._first], [], [], 0)[0]:
            _receive(self._first)  # a header alone, sent whole

    def set_threads(self, threads: int) -> None:
        """The intra-op thread count of every stage from now on (one at first)."""
        for stage in range(len(self._processes)):
            _send(self._sockets[stage], THREADS, -1, index=threads)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights, once everything sent so far is done."""
        state = {}
        for stage in range(len(self._processes)):
            _send(self._sockets[stage], STATE, -1, index=self._step)
            while True:
                kind, step, index, tensor = _receive(self._sockets[stage])
                if kind == DONE and step == -1:
                    break
                if kind == STATE:
                    state[self._key_order[index]] = tensor.clone()
        return {key: state[key] for key in self._key_order}

    def close(self) -> None:
        """Stops the stage processes."""
        for sock in self._sockets.values():
            try:
                _send(sock, STOP, 0)
            except OSError:
                pass
            sock.close()
        for process in self._processes:
            reap(process, 10)

    def __enter__(self) -> Floor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def one_process(adam: dict | None = None) -> tuple[LayerList, torch.optim.Optimizer]:
    """The same model and optimizer in this process, from the same weights as the floor's stages."""
    torch.manual_seed(0)
    model = LayerList(TEST_RESIDUAL_SMALL)
    return model, torch.optim.Adam(model.parameters(), lr=LR, **(adam or {}))


def check(batch: int = 32, steps: int = 20, adam: dict | None = None) -> float:
    """Trains the floor and one process for `steps` steps on the same batch; the largest weight difference."""
    x, y = _make_data(batch, 0)
    model, optimizer = one_process(adam)
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    with Floor(adam=adam) as floor:
        for _ in range(steps):
            floor.train_step(x, y)
        trained = floor.state_dict()
    return max((trained[key] - value).abs().max().item() for key, value in model.state_dict().items())


def median_time(step, steps: int) -> float:
    """The median wall time of `steps` calls of `step`."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each stage and of one process")
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)    # a stage process, started by Floor
    parser.add_argument("--stages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sockets", help=argparse.SUPPRESS)            # {party: inherited fd}
    parser.add_argument("--adam", default="{}", help=argparse.SUPPRESS)  # Adam's keyword arguments besides lr
    args = parser.parse_args()
    if args.stage is not None:
        sockets = {int(party): socket.socket(fileno=fd) for party, fd in json.loads(args.sockets).items()}
        _stage_main(args.stage, args.stages, sockets, json.loads(args.adam))
        return
    torch.set_num_threads(1)  # the check compares arithmetic done in the same order
    print(f"check: after 20 steps the floor's weights are within {check(args.batch):.2g} "
          "of one process's")
    torch.set_num_threads(args.threads)
    x, y = _make_data(args.batch, 0)
    model, optimizer = one_process()

    def single() -> None:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    times: dict[str, list[float]] = {"one process": [], "floor": []}
    with Floor() as floor:
        floor.set_threads(args.threads)
        median_time(lambda: floor.train_step(x, y), 30)
        median_time(single, 30)
        for _ in range(args.rounds):
            times["one process"].append(median_time(single, args.steps))
            times["floor"].append(median_time(lambda: floor.train_step(x, y), args.steps))
    one, low = (statistics.median(times[name]) for name in ("one process", "floor"))
    print(f"batch {args.batch}: one process {one * 1e3:.2f} ms a step, the floor on 3 processes {low * 1e3:.2f} ms "
          f"({low / one:.2f}x); rounds: " + "; ".join(f"{name} " + " ".join(f"{t * 1e3:.2f}" for t in values)
                                                       for name, values in times.items()))


if __name__ == "__main__":
    main()
