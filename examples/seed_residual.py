"""The seed's residual model, unchanged, trained on 3 local shards with the plain PyTorch loop.

    python examples/seed_residual.py

TEST_RESIDUAL_SMALL is the seed's layer list, `(layer_class, kwargs, input_shape)` per layer:
`out_variables` names a layer's saved output ("res_1"), `dependencies` hands saved outputs to a
later layer's forward. client_sdk.seed_models holds it exactly as the seed wrote it, wrapped_linear
included; a class like it defined in your own script works the same way (tests/integration/
test_training.py trains one defined in __main__).
"""

import torch

from client_sdk import Cluster
from client_sdk.seed_models import TEST_RESIDUAL_SMALL


def main() -> None:
    torch.manual_seed(0)
    x = torch.rand(32, 1) * 2 - 1
    y = (torch.sin(3 * x) + 1) / 2
    with Cluster.local(num_shards=3) as cluster:
        model = cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=(torch.optim.Adam, {"lr": 3e-3}))
        print(model)
        for step in range(100):
            pred = model(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            loss.backward()
            model.step()
            model.zero_grad()
            if step % 20 == 0 or step == 99:
                print(f"step {step:3d}  loss {loss.item():.5f}")
        print({key: tuple(value.shape) for key, value in model.state_dict().items()})


if __name__ == "__main__":
    main()
