"""Cases run on every rank of a 2-process gloo group by ``worker.py`` (started by
tests/test_sharded_torch.py): each takes the device mesh and raises AssertionError on a
failure. ``full_tensor()`` appears here only, to compare with the single-process result;
diffiface itself never gathers."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import diffiface as di
from diffiface.test import check_gradients

CASES: dict[str, Callable[[Any], None]] = {}


def case(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    CASES[fn.__name__] = fn
    return fn


def full_problem() -> tuple[dict[str, Any], Any]:
    """The same parameters and data on every rank (seeded): w (4, 3), b (3,), data (5, 4)."""
    generator = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4, 3, generator=generator, dtype=torch.float64),
        "b": torch.randn(3, generator=generator, dtype=torch.float64),
    }
    return params, torch.randn(5, 4, generator=generator, dtype=torch.float64)


def sharded_problem(mesh: Any) -> tuple[dict[str, Any], Any]:
    """w sharded by rows over the 2 ranks, b and the data replicated."""
    params, data = full_problem()
    return (
        {
            "w": distribute_tensor(params["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(params["b"], mesh, [Replicate()]),
        },
        distribute_tensor(data, mesh, [Replicate()]),
    )


def loss(p: Any, data: Any) -> Any:
    return (torch.tanh(data @ p["w"] + p["b"]) ** 2).sum()


def elementwise(w: Any) -> Any:
    return (torch.sin(w) ** 2).sum()


def layout_kept(result: dict[str, Any], x: dict[str, Any]) -> None:
    for key in x:
        assert isinstance(result[key], DTensor), (key, type(result[key]))
        assert result[key].placements == x[key].placements, (key, result[key].placements, x[key].placements)
        assert result[key].device_mesh == x[key].device_mesh, key
        assert result[key].dtype == x[key].dtype and result[key].device == x[key].device, key
        assert not result[key].requires_grad, key


def close(a: Any, b: Any, tol: float = 1e-10) -> None:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    b = b.full_tensor() if isinstance(b, DTensor) else b
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


def local_copies(x: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local().clone() for k, v in x.items()}


def unchanged(x: dict[str, Any], before: dict[str, Any]) -> None:
    for k, v in x.items():
        assert torch.equal(v.to_local(), before[k]), k
        assert v.grad is None and not v.requires_grad, k


def raises(kind: type[BaseException], text: str, call: Callable[[], Any]) -> str:
    with pytest.raises(kind, match=re.escape(text)) as info:
        call()
    return str(info.value)


def plain_gradient(mode: str = "autograd") -> dict[str, Any]:
    params, data = full_problem()
    return di.gradient(loss, di.AutoTorch(mode=mode), params, di.Constant(data))  # type: ignore[no-any-return]


@case
def gradient_autograd(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    before = local_copies(x)
    grad = di.gradient(loss, di.AutoTorch(), x, di.Constant(data))
    layout_kept(grad, x)
    for key in x:
        close(grad[key], plain_gradient()[key])
    unchanged(x, before)


@case
def gradient_func(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    before = local_copies(x)
    grad = di.gradient(loss, di.AutoTorch(mode="func"), x, di.Constant(data))
    layout_kept(grad, x)
    for key in x:
        close(grad[key], plain_gradient("func")[key])
    unchanged(x, before)


@case
def value_and_gradient_both_modes_prepared(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    params, full_data = full_problem()
    for mode in ("autograd", "func"):
        backend = di.AutoTorch(mode=mode)
        prep = di.prepare_value_and_gradient(loss, backend, x, di.Constant(data))
        value, grad = di.value_and_gradient(loss, backend, x, di.Constant(data), prep=prep)
        close(value, loss(params, full_data))
        layout_kept(grad, x)
        close(grad["w"], plain_gradient()["w"])


@case
def elementwise_gradient_stays_sharded_and_nothing_is_gathered(mesh: Any) -> None:
    w = distribute_tensor(full_problem()[0]["w"], mesh, [Shard(0)])
    for backend in (di.AutoTorch(), di.AutoTorch(mode="func")):
        with CommDebugMode() as comm:
            grad = di.gradient(elementwise, backend, w)
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        assert not any("gather" in op for op in counts), counts
        assert isinstance(grad, DTensor) and grad.placements == w.placements
        assert grad.to_local().shape == w.to_local().shape
        close(grad, torch.sin(2 * full_problem()[0]["w"]))


@case
def vjp_with_a_dtensor_cotangent_and_refused_with_a_plain_one(mesh: Any) -> None:
    x, data = sharded_problem(mesh)

    def outputs(p: Any, data: Any) -> Any:
        return torch.tanh(data @ p["w"] + p["b"])

    params, full_data = full_problem()
    ty_full = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
    expected = di.vjp(outputs, di.AutoTorch(), params, ty_full, di.Constant(full_data))
    for mode in ("autograd", "func"):
        backend = di.AutoTorch(mode=mode)
        ty = distribute_tensor(ty_full, mesh, [Replicate()])
        got = di.vjp(outputs, backend, x, ty, di.Constant(data))
        layout_kept(got, x)
        for key in x:
            close(got[key], expected[key])
        raises(
            di.InvalidInputError,
            "cotangent of a DTensor output",
            lambda backend=backend: di.vjp(outputs, backend, x, ty_full, di.Constant(data)),
        )


@case
def forward_mode_refused_on_dtensors(mesh: Any) -> None:
    w = distribute_tensor(full_problem()[0]["w"], mesh, [Shard(0)])
    t = distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Shard(0)])
    for mode, engine in (("autograd", "forward_ad"), ("func", "torch.func.jvp")):
        raises(
            di.UnsupportedOperationError, engine, lambda mode=mode: di.jvp(elementwise, di.AutoTorch(mode=mode), w, t)
        )
    raises(di.UnsupportedOperationError, "torch.func.jvp", lambda: di.hvp(elementwise, di.AutoTorch(mode="func"), w, t))


@case
def jacobian_and_hessian_refused(mesh: Any) -> None:
    w = distribute_tensor(full_problem()[0]["w"], mesh, [Shard(0)])
    for mode in ("autograd", "func"):
        backend = di.AutoTorch(mode=mode)
        raises(di.UnsupportedOperationError, "A Jacobian", lambda b=backend: di.jacobian(torch.sin, b, w))
        raises(di.UnsupportedOperationError, "A Hessian", lambda b=backend: di.hessian(elementwise, b, w))
    over = di.SecondOrder(di.AutoTorch(), di.AutoTorch())
    raises(di.UnsupportedOperationError, "DTensor", lambda: di.hessian(elementwise, over, w))


@case
def hvp_autograd(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    params, full_data = full_problem()
    t_full = {"w": torch.linspace(0, 1, 12, dtype=torch.float64).reshape(4, 3), "b": torch.ones(3, dtype=torch.float64)}
    t = {
        "w": distribute_tensor(t_full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(t_full["b"], mesh, [Replicate()]),
    }
    before = local_copies(t)
    got = di.hvp(loss, di.AutoTorch(), x, t, di.Constant(data))
    layout_kept(got, x)
    expected = di.hvp(loss, di.AutoTorch(), params, t_full, di.Constant(full_data))
    for key in x:
        close(got[key], expected[key])
    unchanged(t, before)


@case
def finite_differences_jvp_collective(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    params, full_data = full_problem()
    t_full = {
        "w": torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3),
        "b": torch.ones(3, dtype=torch.float64),
    }
    t = {
        "w": distribute_tensor(t_full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(t_full["b"], mesh, [Replicate()]),
    }
    expected = di.jvp(loss, di.AutoTorch(), params, t_full, di.Constant(full_data))
    for method in ("central", "forward", "backward"):
        with CommDebugMode() as comm:
            got = di.jvp(loss, di.AutoFiniteDifferences(method=method), x, t, di.Constant(data))
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        assert isinstance(got, torch.Tensor) and got.shape == () and got.dtype == torch.float64
        close(got, expected, 1e-5 if method == "central" else 1e-3)
    value, got = di.value_and_jvp(loss, di.AutoFiniteDifferences(), x, t, di.Constant(data))
    close(value, loss(params, full_data))
    zero = {k: torch.zeros_like(v) for k, v in t.items()}
    close(di.jvp(loss, di.AutoFiniteDifferences(), x, zero, di.Constant(data)), torch.zeros((), dtype=torch.float64))
    plain = {"w": t_full["w"], "b": t_full["b"]}
    raises(
        di.InvalidInputError,
        "tangent of a DTensor x",
        lambda: di.jvp(loss, di.AutoFiniteDifferences(), x, plain, di.Constant(data)),
    )
    assert counts, "expected scalar all-reduces"


@case
def finite_differences_jvp_mixed_scales(mesh: Any) -> None:
    """A large leaf that the tangent does not move leaves the step along the others small."""
    w = torch.linspace(-1, 1, 4, dtype=torch.float64)
    x = {
        "w": distribute_tensor(w, mesh, [Shard(0)]),
        "n": distribute_tensor(torch.full((2,), 1e8, dtype=torch.float64), mesh, [Replicate()]),
    }
    t = {
        "w": distribute_tensor(torch.ones(4, dtype=torch.float64), mesh, [Shard(0)]),
        "n": distribute_tensor(torch.zeros(2, dtype=torch.float64), mesh, [Replicate()]),
    }
    got = di.jvp(lambda p: torch.sin(p["w"]).sum() + 1e-9 * p["n"].sum(), di.AutoFiniteDifferences(), x, t)
    close(got, torch.cos(w).sum(), 1e-8)


@case
def finite_differences_elementwise_refused(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    for op in (di.gradient, di.hessian):
        raises(
            di.UnsupportedOperationError,
            "one entry at a time",
            lambda op=op: op(loss, di.AutoFiniteDifferences(), x, di.Constant(data)),
        )
    raises(di.UnsupportedOperationError, "gather", lambda: di.gradient(loss, di.AutoScipy(), x, di.Constant(data)))


@case
def check_gradients_collective(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    report = check_gradients(loss, x, di.Constant(data))
    statuses = {row.backend: row.status for row in report.rows}
    assert statuses == {"torch": "passed", "torch-func": "passed", "torch vs torch-func": "passed"}, statuses
    assert "collective" in report.rows[0].reference
    w = distribute_tensor(full_problem()[0]["w"], mesh, [Shard(0)])
    with CommDebugMode() as comm:
        check_gradients(elementwise, w, projections=3)
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert not any("gather" in op for op in counts), counts


class _WrongBackward(torch.autograd.Function):
    """sin(w) whose backward forgets the cosine: a wrong derivative check_gradients must catch."""

    @staticmethod
    def forward(ctx: Any, w: Any) -> Any:
        return torch.sin(w)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


@case
def check_gradients_catches_a_wrong_gradient(mesh: Any) -> None:
    w = distribute_tensor(full_problem()[0]["w"], mesh, [Shard(0)])
    message = raises(
        AssertionError,
        "projection",
        lambda: check_gradients(lambda w: _WrongBackward.apply(w).sum(), w, backends=["torch"]),
    )
    assert "torch" in message


@case
def guard_refuses_writes_into_dtensors(mesh: Any) -> None:
    x, data = sharded_problem(mesh)
    before, data_before = local_copies(x), data.to_local().clone()

    def writes_x(p: Any, data: Any) -> Any:
        p["w"].mul_(2)
        return loss(p, data)

    def writes_data(p: Any, data: Any) -> Any:
        data.add_(1)
        return loss(p, data)

    for backend in (di.AutoTorch(), di.AutoFiniteDifferences()):
        raises(
            di.MutationError,
            "into its input",
            lambda backend=backend: (
                di.gradient(writes_x, backend, x, di.Constant(data))
                if backend.name == "torch"
                else di.jvp(writes_x, backend, x, x, di.Constant(data))
            ),
        )
        raises(
            di.MutationError,
            "Constant",
            lambda backend=backend: (
                di.gradient(writes_data, backend, x, di.Constant(data))
                if backend.name == "torch"
                else di.jvp(writes_data, backend, x, x, di.Constant(data))
            ),
        )
    unchanged(x, before)
    assert torch.equal(data.to_local(), data_before)


@case
def module_with_dtensor_parameters_and_fsdp2_refused(mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    data_full = full_problem()[1]

    def model_loss(params: Any, model: Any, data: Any) -> Any:
        return (torch.func.functional_call(model, params, (data,)) ** 2).sum()

    expected = di.gradient(model_loss, di.AutoTorch(), full, di.Constant(model), di.Constant(data_full))

    def shard_rows(name: str, module: Any, mesh: Any) -> None:
        for key, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))

    sharded = distribute_module(model, mesh, shard_rows)
    x = {k: v.detach() for k, v in sharded.named_parameters()}
    data = distribute_tensor(data_full, mesh, [Replicate()])
    for mode in ("autograd", "func"):
        grad = di.gradient(model_loss, di.AutoTorch(mode=mode), x, di.Constant(sharded), di.Constant(data))
        layout_kept(grad, x)
        for key in x:
            close(grad[key], expected[key])
        assert all(p.grad is None for p in sharded.parameters())
    fsdp = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    fully_shard(fsdp, mesh=mesh)
    params = {k: v.detach() for k, v in fsdp.named_parameters()}
    raises(
        di.UnsupportedOperationError,
        "FSDP2",
        lambda: di.gradient(model_loss, di.AutoTorch(), params, di.Constant(fsdp), di.Constant(data_full)),
    )


@case
def mixed_plain_and_dtensor_in_f_explained(mesh: Any) -> None:
    x, _ = sharded_problem(mesh)
    raises(
        di.FrameworkMismatchError,
        "distribute_tensor",
        lambda: di.gradient(loss, di.AutoTorch(), x, di.Constant(full_problem()[1])),
    )
