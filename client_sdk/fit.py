"""model.fit: epochs of training steps over a data source, with validation, checkpoints, callbacks, a progress bar
and a history to plot; Ctrl-C stops after the step under way with the model intact."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from client_sdk import charts
from client_sdk.ctrl_c import CtrlC
from client_sdk.data_source import RowBatch
from shardtrain.errors import InvalidArgument, RolledBack

log = logging.getLogger("shardtrain.sdk.fit")

Callback = Callable[["History", "StepRecord"], object]  # returns True to stop after this step


@dataclass(frozen=True)
class StepRecord:
    """One training step: its number (from 1 over the whole fit), epoch, loss, rows and when it ended."""

    step: int
    epoch: int
    loss: float
    rows: int
    seconds: float  # since fit started


@dataclass
class History:
    """What fit did: every step's loss, each epoch's mean training and validation loss, and whether it was
    interrupted. `plot()` draws the loss curves."""

    steps: list[StepRecord] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)  # {"epoch", "loss", "val_loss" (None without validation)}
    interrupted: bool = False

    @property
    def losses(self) -> list[float]:
        """Every step's training loss, in order."""
        return [record.loss for record in self.steps]

    def plot(self, path: str | os.PathLike | None = None):
        """A matplotlib figure of the training loss per step and each epoch's validation loss; saved as PNG when
        given a path."""
        figure, axes = charts.pyplot().subplots(figsize=(7, 4))
        axes.plot([r.step for r in self.steps], self.losses, label="training loss", linewidth=1)
        ends = {record.epoch: record.step for record in self.steps}  # each epoch's last step
        validated = [(ends[e["epoch"]], e["val_loss"]) for e in self.epochs if e["val_loss"] is not None]
        if validated:
            axes.plot(*zip(*validated), "o-", label="validation loss")
        axes.set_xlabel("step")
        axes.set_ylabel("loss")
        if self.losses and min(self.losses) > 0 and max(self.losses) / min(self.losses) > 100:
            axes.set_yscale("log")
        axes.legend()
        axes.grid(alpha=0.3)
        return charts.finished(figure, path)


class StopAfterStep(CtrlC):
    """While fit runs on a script's main thread, a first Ctrl-C asks it to stop once the step under way is done,
    so the interrupt never lands between two calls of one step, wherever Python is; a second Ctrl-C raises
    KeyboardInterrupt at once. Calls outside fit are the SDK loop's, which cancels them at an await."""

    def check(self) -> None:
        """KeyboardInterrupt if Ctrl-C asked to stop: called between steps."""
        if self.fired:
            raise KeyboardInterrupt


class Fit:
    """One fit call's loop; see DistributedModel.fit for the arguments."""

    def __init__(self, model, loss_fn, loss_output, microbatches: int | None, schedule: str, loop: bool,
                 checkpoint_every: int | None, checkpoint_dir, callbacks: list[Callback]):
        if loop and (microbatches or loss_output is not None):
            raise InvalidArgument("fit(loop=True) trains with model(x), backward and step: it takes neither "
                                  "microbatches nor loss_output (those are train_step's)")
        if checkpoint_every is not None and (checkpoint_every < 1 or checkpoint_dir is None):
            raise InvalidArgument(f"checkpoint_every={checkpoint_every!r} needs a count >= 1 and a checkpoint_dir")
        self.model, self.loss_fn, self.loss_output = model, loss_fn, loss_output
        self.microbatches, self.schedule, self.loop = microbatches or 1, schedule, loop
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, checkpoint_dir
        self.callbacks = callbacks
        self.history = History()
        self._client_loss = None  # the loss computed here: the loop's, and validation's
        self._since_snapshot: list = []  # with model.snapshot_every: the batches trained on since the last snapshot
        self._interrupt = StopAfterStep()

    def run(self, data: Iterable, epochs: int, validation: Iterable | None, progress) -> History:
        if not isinstance(epochs, int) or epochs < 1:
            raise InvalidArgument(f"epochs must be a whole number >= 1, got {epochs!r}")
        total = _length(data)
        bar = _progress(progress, total * epochs if total is not None else None)
        started = time.perf_counter()
        try:
            with self._interrupt:
                for epoch in range(1, epochs + 1):
                    if self._epoch(data, epoch, bar, started):
                        break
                    val_loss = self.validate(validation) if validation is not None else None
                    self._interrupt.check()
                    self._end_epoch(epoch, val_loss, bar)
        except KeyboardInterrupt:
            self.history.interrupted = True
            self.model.synchronize()  # the step under way settles (applied everywhere or nowhere)
            done = self.history.steps[-1].step if self.history.steps else 0
            print(f"fit interrupted after step {done}: the model and its optimizer state are intact on the shards; "
                  "call fit again to go on, or save_checkpoint to keep them")
        finally:
            if bar is not None:
                bar.close()
        return self.history

    def _epoch(self, data: Iterable, epoch: int, bar, started: float) -> bool:
        """Trains one pass over `data`; whether a callback asked to stop."""
        self.model.train()
        for batch in data:
            loss, rows = self._step_surviving(batch)
            record = StepRecord(len(self.history.steps) + 1, epoch, loss, rows, time.perf_counter() - started)
            self.history.steps.append(record)
            if self.checkpoint_every and record.step % self.checkpoint_every == 0:
                self.model.save_checkpoint(os.path.join(self.checkpoint_dir, f"step-{record.step}"))
            if bar is not None:
                rows_per_second = sum(r.rows for r in self.history.steps) / max(record.seconds, 1e-9)
                bar.set_postfix(epoch=epoch, loss=f"{loss:.4g}", samples_per_s=f"{rows_per_second:.0f}")
                bar.update(1)
            if any(callback(self.history, record) is True for callback in self.callbacks):
                return True
            self._interrupt.check()
        return False

    def _step_surviving(self, batch) -> tuple[float, int]:
        """One step on `batch`. With model.snapshot_every, the batches since the last snapshot are kept: when a dead
        shard sends the model back to that snapshot (RolledBack), they are trained on again, then `batch`."""
        while True:
            try:
                result = self._step(batch)
                break
            except RolledBack as rolled:
                lost, self._since_snapshot = self._since_snapshot, []  # the steps since that snapshot
                log.warning("%s; fit trains again on the %d batches since", rolled, len(lost))
                for again in lost:
                    self._step_surviving(again)
        if self.model.snapshot_every and not self.loop:
            if self.model.steps_done % self.model.snapshot_every == 0:  # a snapshot was taken after it
                self._since_snapshot = []
            else:
                self._since_snapshot.append(batch)
        return result

    def _step(self, batch) -> tuple[float, int]:
        if isinstance(batch, RowBatch):
            if not self.loop:  # the stages read the rows themselves
                return self.model.train_step(batch, loss_fn=self.loss_fn, loss_output=self.loss_output,
                                             microbatches=self.microbatches, schedule=self.schedule), len(batch)
            batch = batch.read()
        if self.loss_output is not None:
            return self.model.train_step(batch, loss_output=self.loss_output, microbatches=self.microbatches,
                                         schedule=self.schedule), _rows(batch)
        x, y = _pair(batch)
        if not self.loop:
            return self.model.train_step(x, y, self.loss_fn, microbatches=self.microbatches,
                                         schedule=self.schedule), _rows(x)
        self.model.zero_grad()
        loss = self._loss(_call(self.model, x), y)
        loss.backward()
        self.model.step()
        return loss.item(), _rows(x)

    def validate(self, data: Iterable) -> float:
        """The mean loss over `data` in eval mode without gradients, weighted by each batch's rows."""
        self.model.eval()
        total, rows = 0.0, 0
        try:
            with torch.no_grad():
                for batch in data:
                    if isinstance(batch, RowBatch):
                        batch = batch.read()  # read here: the loss is taken here
                    if self.loss_output is not None:
                        outputs = _call(self.model, batch)
                        loss, count = outputs[self.loss_output], _rows(batch)
                    else:
                        x, y = _pair(batch)
                        loss, count = self._loss(_call(self.model, x), y), _rows(x)
                    total, rows = total + loss.item() * count, rows + count
        finally:
            self.model.train()
        if not rows:
            raise InvalidArgument("the validation data gave no batches")
        return total / rows

    def _loss(self, prediction, y) -> torch.Tensor:
        if self._client_loss is None:
            self._client_loss = _loss_callable(self.loss_fn)
        if isinstance(prediction, tuple):
            prediction = prediction[0]  # train_step's loss_fn takes the model's first output too
        return self._client_loss(prediction, y)

    def _end_epoch(self, epoch: int, val_loss: float | None, bar) -> None:
        losses = [r.loss for r in self.history.steps if r.epoch == epoch]
        entry = {"epoch": epoch, "loss": sum(losses) / len(losses) if losses else math.nan, "val_loss": val_loss}
        self.history.epochs.append(entry)
        if bar is not None and val_loss is not None:
            bar.write(f"epoch {epoch}: loss {entry['loss']:.4g}, validation loss {val_loss:.4g}",
                      file=getattr(bar, "fp", None))


def _loss_callable(loss_fn) -> Callable:
    """The loss as a function of (prediction, target): a torch.nn loss by name or class, or a module or function."""
    if isinstance(loss_fn, str):
        if not hasattr(torch.nn, loss_fn):
            raise InvalidArgument(f"loss {loss_fn!r} is not a torch.nn loss")
        return getattr(torch.nn, loss_fn)()
    if isinstance(loss_fn, type):
        return loss_fn()
    if not callable(loss_fn):
        raise InvalidArgument(f"loss_fn must be a torch.nn loss (name, class or instance) or a function, got "
                              f"{loss_fn!r}")
    return loss_fn


def _pair(batch) -> tuple:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InvalidArgument("fit's data must give (x, y) batches, or x alone with loss_output= naming the "
                              f"model's loss output; got a {type(batch).__name__}")
    return batch[0], batch[1]


def _call(model, x):
    """model(x), model(*x) for a tuple of inputs or model(**x) for a dict, as train_step takes x."""
    if isinstance(x, dict):
        return model(**x)
    return model(*x) if isinstance(x, (tuple, list)) else model(x)


def _rows(x) -> int:
    first = x
    while isinstance(first, (tuple, list)):
        first = first[0]
    if isinstance(first, dict):
        first = next(iter(first.values()))
    return len(first) if isinstance(first, torch.Tensor) and first.dim() else 1


def _length(data: Iterable) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def _progress(progress, total: int | None):
    """A tqdm bar (a widget in Jupyter, text on a terminal's stderr, or on the text stream `progress` names), or
    None for progress=False."""
    if progress is False or progress is None:
        return None
    if importlib.util.find_spec("ipywidgets") is not None:  # what tqdm's notebook widget needs
        from tqdm.auto import tqdm
    else:  # tqdm.auto would warn in Jupyter, then draw the text bar anyway
        from tqdm.std import tqdm
    if progress is True:
        return tqdm(total=total, unit="step", dynamic_ncols=True)
    return tqdm(total=total, unit="step", file=progress, ascii=True)
