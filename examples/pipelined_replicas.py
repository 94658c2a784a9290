"""The seed's residual model as 2 replicas x 2 pipeline stages, trained with model.train_step.

    python examples/pipelined_replicas.py

Each step splits the batch over the replicas, cuts each share into micro-batches that flow through
the two stages under 1F1B, computes the loss on the last stage, sums the replicas' gradients with
gloo, and steps every shard. model.stats() shows what each shard did in the last step.
"""

import torch

from client_sdk import Cluster
from client_sdk.seed_models import TEST_RESIDUAL_SMALL


def main() -> None:
    torch.manual_seed(0)
    with Cluster.local(num_shards=4) as cluster:
        model = cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=(torch.optim.Adam, {"lr": 3e-3}),
                               num_stages=2, replicas=2)
        print(model)
        for step in range(100):
            x = torch.rand(64, 1) * 2 - 1
            loss = model.train_step(x, (torch.sin(3 * x) + 1) / 2, torch.nn.MSELoss(), microbatches=4)
            if step % 20 == 0 or step == 99:
                print(f"step {step:3d}  loss {loss:.5f}")
        for shard in model.stats():
            print(f"replica {shard['replica']} stage {shard['stage']}: busy {shard['busy_fraction']:.0%}, "
                  f"peak activations {shard['peak_activation_bytes'] / 1024:.0f} KiB, "
                  f"{shard['peak_in_flight']} micro-batches in flight at most")


if __name__ == "__main__":
    main()
