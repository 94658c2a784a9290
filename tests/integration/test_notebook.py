"""A notebook's interrupt, in a real Jupyter kernel: it stops the cell's call, not the local cluster the notebook
started; the weights trained so far stay readable and training goes on."""

from __future__ import annotations

import time

import pytest

manager = pytest.importorskip("jupyter_client.manager", reason="needs jupyter_client and ipykernel (the dev extras)")

SETUP = """
import torch
from torch import nn
from client_sdk import Cluster
cluster = Cluster.local(num_shards=2)
torch.manual_seed(0)
model = cluster.deploy(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
x, y = torch.randn(256, 64), torch.randn(256, 1)
"""

TRAIN_UNTIL_INTERRUPTED = """
steps = 0
while True:
    nn.functional.mse_loss(model(x), y).backward()
    model.step()
    model.zero_grad()
    steps += 1
    if steps == 1:
        print("training", flush=True)
"""

AFTERWARDS = """
state = model.state_dict()
nn.functional.mse_loss(model(x), y).backward()
model.step()
print(steps > 0, sorted(state))
cluster.close()
"""


class Kernel:
    """A python3 kernel driven as a notebook drives it: cells executed one after another, interrupts."""

    def __init__(self):
        self.manager, self.client = manager.start_new_kernel(kernel_name="python3")

    def send(self, code: str) -> str:
        return self.client.execute(code)

    def reply(self, msg_id: str, timeout: float = 120) -> dict:
        """The reply to request `msg_id` (a kernel_info reply from the start may still wait before it)."""
        while True:
            message = self.client.get_shell_msg(timeout=timeout)
            if message["parent_header"].get("msg_id") == msg_id:
                return message["content"]

    def run(self, code: str, timeout: float = 120) -> tuple[dict, str]:
        """A cell's reply and what it printed."""
        msg_id = self.send(code)
        reply, printed = self.reply(msg_id, timeout), []
        while True:
            message = self.client.get_iopub_msg(timeout=timeout)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                return reply, "".join(printed)

    def wait_for_output(self, msg_id: str, text: str, timeout: float = 120) -> None:
        """Until the cell `msg_id` has printed `text` (it is running, past its first steps)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
            if (message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream"
                    and text in message["content"]["text"]):
                return
        raise TimeoutError(f"the cell did not print {text!r} within {timeout:g} s")

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def test_interrupting_a_training_cell_keeps_the_cluster_and_its_weights():
    kernel = Kernel()
    try:
        assert kernel.run(SETUP)[0]["status"] == "ok"
        training = kernel.send(TRAIN_UNTIL_INTERRUPTED)
        kernel.wait_for_output(training, "training")  # interrupted mid-loop, however busy the machine
        kernel.manager.interrupt_kernel()  # signals the kernel's whole process group
        interrupted = kernel.reply(training)
        assert (interrupted["status"], interrupted.get("ename")) == ("error", "KeyboardInterrupt"), interrupted
        reply, printed = kernel.run(AFTERWARDS)
        assert reply["status"] == "ok", reply.get("evalue")
        assert printed == "True ['0.bias', '0.weight', '2.bias', '2.weight']\n"
    finally:
        kernel.close()
