"""The seed's test models, as the seed writes them: a layer-list format with named residuals."""

import torch.nn as nn


class wrapped_linear(nn.Module):  # noqa: N801 - the seed's name
    """The seed's Linear that adds its dependency (a saved residual) and can save its own output.

    Note (kept as in the seed): with `out_variables` empty it returns `self.linear(x)`, so the
    residual it adds is discarded and gets no gradient.
    """

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
