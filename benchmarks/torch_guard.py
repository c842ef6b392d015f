"""diffiface's prepared torch gradient against ``torch.autograd.grad`` on what torch users pass:
a trainable head on a frozen backbone passed as ``di.Constant``, a 4 MB batch, the parameters of
``named_parameters()``; and the autograd-mode Jacobian at n = 1000 against ``torch.func.jacrev``.
One process, one thread, interleaved rounds; run it pinned::

    taskset -c 1 python benchmarks/torch_guard.py

Prints, per case, the native call's time and diffiface's ratio to it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved

import diffiface as di


def backbone_case() -> dict[str, Any]:
    """A 4.2M-parameter frozen backbone (eval mode, no grad) as a Constant, a trainable head."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 1024),
        torch.nn.LayerNorm(1024),
    ).eval()
    backbone.requires_grad_(False)
    head = {"w": torch.randn(1024, 10) * 0.01, "b": torch.zeros(10)}
    batch = torch.randn(64, 256)

    def loss(p: Any, net: Any, data: Any) -> Any:
        return (net(data) @ p["w"] + p["b"]).square().mean()

    def native() -> Any:
        leaves = [v.detach().requires_grad_(True) for v in head.values()]
        return torch.autograd.grad(loss(dict(zip(head, leaves, strict=True)), backbone, batch), leaves)

    contexts = (di.Constant(backbone), di.Constant(batch))
    return {"loss": loss, "x": head, "contexts": contexts, "native": native}


def batch_case(rows: int, parameters: bool) -> dict[str, Any]:
    """A 64-128-16 MLP's ``named_parameters()`` (or detached copies) on a batch of ``rows``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16))
    params = dict(model.named_parameters()) if parameters else {k: v.detach() for k, v in model.named_parameters()}
    data, target = torch.randn(rows, 64), torch.randn(rows, 16)

    def loss(p: Any, d: Any, t: Any) -> Any:
        return (torch.func.functional_call(model, p, (d,)) - t).square().mean()

    def native() -> Any:
        leaves = list(model.parameters())
        return torch.autograd.grad(loss(dict(zip(params, leaves, strict=True)), data, target), leaves)

    return {"loss": loss, "x": params, "contexts": (di.Constant(data), di.Constant(target)), "native": native}


def module_case() -> dict[str, Any]:
    """The model itself as ``di.Constant(model)``, its parameters as x."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16))
    params = dict(model.named_parameters())
    data, target = torch.randn(1024, 64), torch.randn(1024, 16)

    def loss(p: Any, net: Any, d: Any, t: Any) -> Any:
        return (torch.func.functional_call(net, p, (d,)) - t).square().mean()

    def native() -> Any:
        leaves = list(model.parameters())
        return torch.autograd.grad(loss(dict(zip(params, leaves, strict=True)), model, data, target), leaves)

    contexts = (di.Constant(model), di.Constant(data), di.Constant(target))
    return {"loss": loss, "x": params, "contexts": contexts, "native": native}


def main() -> None:
    torch.set_num_threads(1)
    cases = {
        "frozen backbone as Constant": backbone_case(),
        "named_parameters, batch 64": batch_case(64, True),
        "named_parameters, batch 16384 (4 MB)": batch_case(16384, True),
        "detached parameters, batch 16384": batch_case(16384, False),
        "model as di.Constant, batch 1024": module_case(),
    }
    for name, case in cases.items():
        prep = di.prepare_gradient(case["loss"], "torch", case["x"], *case["contexts"])

        def ours(case: dict[str, Any] = case, prep: Any = prep) -> Any:
            return di.gradient(case["loss"], "torch", case["x"], *case["contexts"], prep=prep)

        times = interleaved({"native": case["native"], "diffiface": ours}, rounds=15, repeat=5, warmups=3)
        print(
            f"{name:40s} native {times['native'] * 1e6:9.0f} us  diffiface/native {times['diffiface'] / times['native']:.3f}"
        )
    n = 1000
    x = torch.randn(n, dtype=torch.float64)
    a = torch.randn(n, n, dtype=torch.float64) / 30

    def vector(v: Any) -> Any:
        return torch.tanh(a @ v) * v

    prep = di.prepare_jacobian(vector, "torch", x)
    jacrev = torch.func.jacrev(vector)
    times = interleaved(
        {"native": lambda: jacrev(x), "diffiface": lambda: di.jacobian(vector, "torch", x, prep=prep)},
        rounds=5,
        repeat=3,
    )
    name = "jacobian n=1000 vs torch.func.jacrev"
    print(
        f"{name:40s} native {times['native'] * 1e6:9.0f} us  diffiface/native {times['diffiface'] / times['native']:.3f}"
    )


if __name__ == "__main__":
    main()
