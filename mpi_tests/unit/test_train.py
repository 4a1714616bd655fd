"""The trainer's command line: errors before training starts."""

from __future__ import annotations

import torch

from hvd_lowcomm.loop import nonfinite


def test_the_nonfinite_check_names_the_layer_and_is_not_fooled_by_a_sum_that_overflows():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    assert nonfinite(0.5, model) is None
    assert nonfinite(float("nan"), model) == "loss is nan"
    with torch.no_grad():
        model[2].weight.fill_(3e38)  # finite, but its sum overflows to inf
    assert nonfinite(0.5, model) is None
    model[2].weight.grad[0, 1] = float("inf")
    assert "gradient of layer '2.weight' is not finite" in nonfinite(0.5, model)
    model[2].weight.grad[0, 1] = 0.0
    with torch.no_grad():
        model[0].bias[2] = float("nan")
    assert "parameters of layer '0.bias' are not finite" in nonfinite(0.5, model)
