"""The seed's residual model, exactly as the seed writes it, trained on 3 shards.

Run: python examples/seed_residual.py
"""

import torch
import torch.nn as nn


class wrapped_linear(nn.Module):  # noqa: N801 - the seed's name
    def __init__(self, in_features=None, out_features=None, dependencies=[],  # noqa: B006 - as in the seed
                 out_variables=[]):  # noqa: B006
        super(wrapped_linear, self).__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.dependencies = dependencies
        self.forward_order = dependencies
        self.out_variables = out_variables

    def forward(self, x, noise=None):
        if (len(self.dependencies) != 0):
            if self.dependencies[0] == "random_noise":
                x = x + noise
                lin_out = self.linear(x)
            elif self.dependencies[0] == "res_1":
                lin_out = self.linear(x) + noise
        else:
            lin_out = self.linear(x)
        if (len(self.out_variables) == 1):
            return lin_out, [(self.out_variables[0], lin_out)]
        return self.linear(x)


TEST_RESIDUAL_SMALL = [
        (nn.Linear, {'in_features': 1, 'out_features': 512}, (32, 1)),
        (nn.ReLU, {}, (32, 512)),
        (wrapped_linear, {
            'in_features': 512,
            'out_features': 512,
            'out_variables': ["res_1"]
            }, [(32, 512)]),
        (nn.ReLU, {}, (32, 512)),
        (nn.Linear, {'in_features': 512, 'out_features': 512}, (32, 512)),
        (nn.ReLU, {}, (32, 512)),
        (wrapped_linear, {
            'in_features': 512,
            'out_features': 512,
            'dependencies': ["res_1"],
            'out_variables': []
        }, [(32, 512), (32, 512)]),
        (nn.ReLU, {}, (32, 512)),
        (nn.Linear, {'in_features': 512, 'out_features': 1}, (32, 512)),
        (nn.Sigmoid, {}, (32, 1))
    ]


def main() -> None:
    from client_sdk import Cluster

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
