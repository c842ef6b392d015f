"""The catalogue of bad inputs: each one gets a diffiface exception that says what is wrong and
what to do, and leaves every input (x, tangents, contexts) bit-for-bit as it was.

Each case builds its call lazily, so a case whose engine is not installed is skipped (naming
the extra to install) without importing that engine.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import pytest

import diffiface as di
import diffiface._adapters as adapters

BACKENDS = ("jax", "torch", "autograd", "finite_differences", "scipy")


def need(*backends: str) -> None:
    """Skip unless every engine behind ``backends`` is installed."""
    for backend in backends:
        if not di.available(backend):
            extra = adapters.info(backend).extra
            pytest.skip(f'the {backend} backend is not installed: pip install "diffiface[{extra}]"')


# -- bit-for-bit snapshots of inputs -----------------------------------------------------------


def _leaf_bits(leaf: Any) -> tuple[Any, ...]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        data = leaf.detach().cpu().contiguous()
        raw = (
            data.view(torch.uint8).numpy().tobytes()
            if data.dim()
            else data.reshape(1).view(torch.uint8).numpy().tobytes()
        )
        return ("torch", str(leaf.dtype), tuple(leaf.shape), leaf.requires_grad, leaf.grad is None, raw)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(leaf, jax.Array):
        array = np.asarray(leaf)
        return ("jax", str(array.dtype), array.shape, array.tobytes())
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.kind == "O":
            return ("numpy", "object", leaf.shape, repr(leaf.tolist()))
        return ("numpy", str(leaf.dtype), leaf.shape, leaf.flags.writeable, leaf.tobytes())
    if isinstance(leaf, float):
        return ("float", leaf.hex())
    return (type(leaf).__name__, repr(leaf))


def snapshot(*trees: Any) -> list[tuple[Any, ...]]:
    """Every leaf of ``trees`` (contexts unwrapped) as type, dtype, shape and raw bytes."""
    out = []
    for tree in trees:
        if isinstance(tree, di.Context):
            tree = tree.value
        leaves, spec = optree.tree_flatten(tree)
        out.append(("structure", str(spec)))
        out.extend(_leaf_bits(leaf) for leaf in leaves)
    return out


# -- the catalogue -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One bad input: ``build(monkeypatch)`` returns the failing call and the inputs it must not touch."""

    id: str
    engines: tuple[str, ...]
    error: type[di.DiffifaceError]
    match: str
    build: Callable[[pytest.MonkeyPatch], tuple[Callable[[], Any], tuple[Any, ...]]]


def square_sum(x: Any, *contexts: Any) -> Any:
    return (x**2).sum()


def twice(x: Any, *contexts: Any) -> Any:
    return 2 * x


def numpy_f(x: Any) -> Any:
    """Written for numpy only: np.asarray with a dtype cannot take a traced array."""
    return np.sum(np.asarray(x, dtype=np.float64) ** 2)


def vec() -> np.ndarray:
    return np.array([0.5, -1.25, 2.0])


def _torch() -> Any:
    import torch

    return torch


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp


CASES: list[Case] = []


def case(name: str, engines: tuple[str, ...], error: type[di.DiffifaceError], match: str) -> Callable[[Any], Any]:
    def register(build: Callable[..., Any]) -> Callable[..., Any]:
        CASES.append(Case(name, engines, error, match, build))
        return build

    return register


# f, backend
@case("f-not-callable", (), di.InvalidInputError, r"f must be a callable f\(x, \*contexts\), got float.*argument order")
def _(mp):
    x = vec()
    return lambda: di.gradient(1.5, "finite_differences", x), (x,)


@case("prepare-f-not-callable", ("jax",), di.InvalidInputError, r"f must be a callable.*got str")
def _(mp):
    x = vec()
    return lambda: di.prepare_jacobian("sin", "jax", x), (x,)


@case("backend-unknown-name", (), di.UnknownBackendError, r"Unknown backend name 'theano'.*'jax'.*di\.AutoJAX\(\)")
def _(mp):
    x = vec()
    return lambda: di.gradient(square_sum, "theano", x), (x,)


@case("backend-not-a-backend", (), di.UnknownBackendError, r"backend must be a backend object.*got int")
def _(mp):
    x = vec()
    return lambda: di.gradient(square_sum, 3, x), (x,)


def _uninstalled(module: str, backend: str) -> Callable[..., Any]:
    def build(mp: pytest.MonkeyPatch) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        mp.setitem(sys.modules, module, None)  # importing it now fails, as if not installed
        mp.setattr(adapters, "_adapters", {})
        assert not di.available(backend)
        x = vec()
        return lambda: di.gradient(square_sum, backend, x), (x,)

    return build


for _module, _backend in (("jax", "jax"), ("scipy", "scipy"), ("autograd", "autograd")):
    case(
        f"engine-not-installed-{_backend}",
        (),
        di.BackendUnavailableError,
        rf"The {_backend} backend needs {_module}, which is not installed.*pip install \"diffiface\[{_backend}\]\"",
    )(_uninstalled(_module, _backend))


@case(
    "second-order-untraceable",
    ("jax", "torch"),
    di.UnsupportedOperationError,
    r"jax cannot trace through torch.*same engine",
)
def _(mp):
    x = vec()
    return lambda: di.hessian(square_sum, di.SecondOrder(di.AutoJAX(), di.AutoTorch()), x), (x,)


# backend options
@case("fd-method-unknown", (), di.InvalidBackendOptionError, r"method='fancy'.*choose one of 'central', 'forward'")
def _(mp):
    return lambda: di.AutoFiniteDifferences(method="fancy"), ()


@case("fd-step-negative", (), di.InvalidBackendOptionError, r"step=-0.1.*positive and finite")
def _(mp):
    return lambda: di.AutoFiniteDifferences(step=-0.1), ()


@case("fd-step-not-a-number", (), di.InvalidBackendOptionError, r"step='small'.*positive float, or None")
def _(mp):
    return lambda: di.AutoFiniteDifferences(step="small"), ()


@case("torch-mode-unknown", (), di.InvalidBackendOptionError, r"mode='jit'.*mode='autograd'.*mode='func'")
def _(mp):
    return lambda: di.AutoTorch(mode="jit"), ()


@case("scipy-order-odd", (), di.InvalidBackendOptionError, r"order=3.*even integer")
def _(mp):
    return lambda: di.AutoScipy(order=3), ()


# outputs
for _op, _backend in (
    ("gradient", "finite_differences"),
    ("hessian", "jax"),
    ("hvp", "torch"),
    ("value_and_gradient", "autograd"),
):

    def _build(
        mp: pytest.MonkeyPatch, op: str = _op, backend: str = _backend
    ) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        x, t = vec(), np.ones(3)
        if op == "hvp":
            return lambda: di.hvp(twice, backend, x, t), (x, t)
        return lambda: getattr(di, op)(twice, backend, x), (x,)

    case(
        f"output-not-scalar-{_op}-{_backend}",
        ((_backend,) if _backend != "finite_differences" else ()),
        di.InvalidOutputError,
        rf"{_op} needs f to return a scalar, but it returned an array of shape \(3,\).*\.sum\(\).*jacobian",
    )(_build)


@case("output-string", (), di.InvalidOutputError, r"f returned a str where gradient needs floating-point numbers")
def _(mp):
    x = vec()
    return lambda: di.gradient(lambda x: "loss", "finite_differences", x), (x,)


@case("output-none", ("torch",), di.InvalidOutputError, r"f returned None where jacobian needs.*return statement")
def _(mp):
    x = vec()
    return lambda: di.jacobian(lambda x: None, "torch", x), (x,)


@case("output-none-jax", ("jax",), di.InvalidOutputError, r"f returned None where jvp needs")
def _(mp):
    x, t = vec(), np.ones(3)
    return lambda: di.jvp(lambda x: None, "jax", x, t), (x, t)


@case("output-integer-array", (), di.InvalidOutputError, r"array of dtype int64 where jacobian needs floating-point")
def _(mp):
    x = vec()
    return lambda: di.jacobian(lambda x: np.arange(3), "finite_differences", x), (x,)


def _foreign_output(backend: str, framework: str) -> Callable[[pytest.MonkeyPatch], Any]:
    def build(mp: pytest.MonkeyPatch) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        module = __import__(framework)
        x = vec()
        # a constant, so its derivative is zero, but in an array the engine cannot take
        count = module.tensor(3.0) if framework == "torch" else module.numpy.asarray(3.0)
        return lambda: di.value_and_gradient(lambda x: count, backend, x), (x,)

    return build


for _backend, _framework in (("autograd", "jax"), ("autograd", "torch"), ("jax", "torch"), ("mlx", "torch")):
    case(
        f"output-{_framework}-under-{_backend}",
        (_backend, _framework),
        di.InvalidOutputError,
        rf"f returned a {_framework} array .* under the {_backend} backend.*AutoFiniteDifferences",
    )(_foreign_output(_backend, _framework))


@case(
    "has-aux-not-a-pair",
    ("jax",),
    di.InvalidOutputError,
    r"has_aux=True, f must return a pair \(value, aux\); it returned an array of shape \(\)",
)
def _(mp):
    x = vec()
    return lambda: di.value_and_gradient(square_sum, "jax", x, has_aux=True), (x,)


@case("has-aux-triple", ("torch",), di.InvalidOutputError, r"must return a pair \(value, aux\); it returned a tuple")
def _(mp):
    x, ty = vec(), np.ones(3)
    return lambda: di.value_and_vjp(lambda x: (2 * x, 1.0, 2.0), "torch", x, ty, has_aux=True), (x, ty)


@case(
    "aux-without-has-aux", ("torch",), di.InvalidOutputError, r"returned a str where hvp.*If f returns \(value, aux\)"
)
def _(mp):
    x, v = vec(), np.ones(3)
    return lambda: di.hvp(lambda x: ((x**3).sum(), "note"), "torch", x, v), (x, v)


@case(
    "aux-tensors-without-has-aux",
    ("jax",),
    di.InvalidOutputError,
    r"returned a tuple with 2 leaves.*pass has_aux=True to di\.value_and_gradient",
)
def _(mp):
    x = vec()
    return lambda: di.value_and_gradient(lambda x: (square_sum(x), x), "jax", x), (x,)


# x
@case(
    "x-integer-array",
    ("jax",),
    di.InvalidInputError,
    r"x has dtype int64; only floating-point and complex.*Cast it to a float dtype.*di\.Constant",
)
def _(mp):
    x = np.arange(3)
    return lambda: di.gradient(square_sum, "jax", x), (x,)


@case("x-python-int", ("autograd",), di.InvalidInputError, r"x has dtype int64.*Cast it to a float dtype")
def _(mp):
    return lambda: di.gradient(square_sum, "autograd", 3), ()


@case(
    "x-bool-leaf",
    ("torch",),
    di.InvalidInputError,
    r"x\['flag'\] has dtype bool.*Cast it to a float dtype, or pass it as a di\.Constant",
)
def _(mp):
    # (beside a float leaf, a bool leaf is static, as in eqx.filter_grad: see test_frameworks)
    x = {"flag": True}
    return lambda: di.gradient(lambda x: float(x["flag"]), "torch", x), (x,)


@case("x-torch-int-tensor", ("torch",), di.InvalidInputError, r"x\[1\] has dtype int64")
def _(mp):
    torch = _torch()
    x = [torch.ones(2), torch.arange(2)]
    return lambda: di.gradient(lambda x: x[0].sum(), "torch", x), (x,)


@case(
    "x-string-leaf",
    (),
    di.InvalidInputError,
    r"x\['name'\] is a str and x holds no float.*di\.Constant\(\.\.\.\)",
)
def _(mp):
    # (beside a float leaf, a string leaf is static, as in eqx.filter_grad: see test_frameworks)
    x = {"name": "layer"}
    return lambda: di.gradient(lambda x: float(len(x["name"])), "finite_differences", x), (x,)


@case("x-complex-valued-gradient", (), di.InvalidOutputError, r"f returned a complex value.*gradient.*Use jvp.*vjp")
def _(mp):
    x = vec() + 1j
    return lambda: di.gradient(lambda x: (x * x).sum(), "finite_differences", x), (x,)


@case("x-complex-valued-gradient-torch", ("torch",), di.InvalidOutputError, r"complex value.*Use jvp.*vjp")
def _(mp):
    x = _torch().ones(3, dtype=_torch().complex64)
    return lambda: di.gradient(lambda x: (x * x).sum(), "torch", x), (x,)


@case(
    "x-complex-step-on-complex", (), di.InvalidBackendOptionError, r"method='complex'.*complex x.*central differences"
)
def _(mp):
    x = vec() + 1j
    return lambda: di.gradient(lambda x: abs(x).sum(), di.AutoFiniteDifferences(method="complex"), x), (x,)


@case("x-complex-hessian", (), di.UnsupportedOperationError, r"hessian of a function of complex x.*Use hvp")
def _(mp):
    x = vec() + 1j
    return lambda: di.hessian(lambda x: (abs(x) ** 2).sum(), "finite_differences", x), (x,)


@case("x-complex-not-holomorphic", (), di.UnsupportedOperationError, r"not holomorphic.*Use jvp.*holomorphic=True")
def _(mp):
    x = vec() + 1j
    return lambda: di.jacobian(lambda x: x.conj() * x, "finite_differences", x), (x,)


@case(
    "x-float16-finite-differences",
    (),
    di.InvalidInputError,
    r"x has dtype float16: finite differences in float16.*Cast x to float32",
)
def _(mp):
    x = vec().astype(np.float16)
    return lambda: di.gradient(square_sum, "finite_differences", x), (x,)


@case(
    "x-bfloat16-torch-finite-differences", ("torch",), di.InvalidInputError, r"x has dtype bfloat16.*Cast x to float32"
)
def _(mp):
    x = _torch().ones(3, dtype=_torch().bfloat16)
    return lambda: di.gradient(square_sum, "finite_differences", x), (x,)


@case("x-float16-scipy", ("scipy",), di.InvalidInputError, r"x\['a'\] has dtype float16.*Cast x to float32")
def _(mp):
    x = {"a": vec().astype(np.float16)}
    return lambda: di.jacobian(lambda x: x["a"] * 2, "scipy", x), (x,)


@case(
    "x-mixed-frameworks",
    ("torch",),
    di.ArrayTypeError,
    r"x mixes arrays of several frameworks \(numpy, torch\); use one framework",
)
def _(mp):
    x = [vec(), _torch().ones(3, dtype=_torch().float64)]
    return lambda: di.gradient(lambda x: (x[0] ** 2).sum(), "finite_differences", x), (x,)


@case(
    "x-torch-under-jax",
    ("jax", "torch"),
    di.ArrayTypeError,
    r"x holds torch arrays, but the jax backend differentiates jax arrays.*torch backend",
)
def _(mp):
    x = _torch().ones(3)
    return lambda: di.gradient(square_sum, "jax", x), (x,)


@case(
    "x-torch-under-autograd",
    ("autograd", "torch"),
    di.ArrayTypeError,
    r"differentiates numpy arrays\. Pass numpy arrays, or use the torch backend\.$",
)
def _(mp):
    x = _torch().ones(3)
    return lambda: di.gradient(square_sum, "autograd", x), (x,)


@case(
    "tangent-torch-for-numpy-x",
    ("torch",),
    di.ArrayTypeError,
    r"x holds numpy arrays under the finite_differences backend\. Pass the tangent as numpy arrays\.$",
)
def _(mp):
    x, tangent = vec(), _torch().ones(3, dtype=_torch().float64)
    return lambda: di.jvp(twice, "finite_differences", x, tangent), (x, tangent)


@case(
    "derivative-of-array",
    (),
    di.InvalidInputError,
    r"derivative needs a scalar x \(a float or a 0-d array\), got \(3,\).*use jacobian",
)
def _(mp):
    x = vec()
    return lambda: di.derivative(twice, "finite_differences", x), (x,)


@case("second-derivative-of-list", ("jax",), di.InvalidInputError, r"second_derivative needs a scalar x.*got 2 leaves")
def _(mp):
    x = [1.0, 2.0]
    return lambda: di.second_derivative(lambda x: x[0] * x[1], "jax", x), (x,)


@case("x-wrapped-in-constant", (), di.ContextError, r"The x of gradient is a di\.Constant, but the x is passed bare")
def _(mp):
    x = di.Constant(vec())
    return lambda: di.gradient(square_sum, "finite_differences", x), (x,)


# tangents and cotangents
@case("tangent-structure", ("jax",), di.TangentMismatchError, r"tangent of jvp must have the structure of x")
def _(mp):
    x, t = {"a": vec()}, [np.ones(3)]
    return lambda: di.jvp(lambda x: 2 * x["a"], "jax", x, t), (x, t)


@case(
    "tangent-shape",
    ("torch",),
    di.TangentMismatchError,
    r"tangent\['a'\] has shape \(4,\), but x\['a'\] has shape \(3,\)",
)
def _(mp):
    x, t = {"a": vec()}, {"a": np.ones(4)}
    return lambda: di.hvp(lambda x: (x["a"] ** 3).sum(), "torch", x, t), (x, t)


@case(
    "tangent-dtype",
    (),
    di.TangentMismatchError,
    r"tangent has dtype float32, but x has dtype float64; cast the tangent to float64",
)
def _(mp):
    x, t = vec(), np.ones(3, dtype=np.float32)
    return lambda: di.jvp(twice, "finite_differences", x, t), (x, t)


@case("cotangent-structure", ("autograd",), di.TangentMismatchError, r"cotangent must have the structure of f\(x\)")
def _(mp):
    x, t = vec(), (np.ones(3),)
    return lambda: di.vjp(twice, "autograd", x, t), (x, t)


@case(
    "cotangent-shape",
    ("torch",),
    di.TangentMismatchError,
    r"Cotangent leaf 0 has shape \(4,\), but f\(x\)'s leaf 0 has shape \(3,\)",
)
def _(mp):
    x, t = vec(), np.ones(4)
    return lambda: di.vjp(twice, "torch", x, t), (x, t)


@case(
    "cotangent-dtype",
    ("jax",),
    di.TangentMismatchError,
    r"Cotangent leaf 0 has dtype float32, but f\(x\)'s leaf 0 has dtype float64; cast the cotangent to float64",
)
def _(mp):
    x, t = vec(), np.ones(3, dtype=np.float32)
    return lambda: di.vjp(twice, "jax", x, t), (x, t)


@case(
    "tangent-is-a-constant",
    ("jax",),
    di.ContextError,
    r"tangent of jvp is a di\.Constant.*passed bare.*di\.jvp\(f, backend, x, tx, \*contexts\)",
)
def _(mp):
    x, c = vec(), di.Constant(np.ones(3))
    return lambda: di.jvp(twice, "jax", x, c), (x, c)


@case(
    "cotangent-is-a-cache",
    (),
    di.ContextError,
    r"cotangent of vjp is a di\.Cache.*di\.vjp\(f, backend, x, ty, \*contexts\)",
)
def _(mp):
    x, c = vec(), di.Cache(np.ones(3))
    return lambda: di.vjp(twice, "finite_differences", x, c), (x, c)


# contexts
@case(
    "bare-extra-argument",
    (),
    di.ContextError,
    r"Argument 4 of gradient is a float, not a context.*di\.Constant\(value\).*di\.Cache\(value\)",
)
def _(mp):
    x = vec()
    return lambda: di.gradient(lambda x, c: (c * x**2).sum(), "finite_differences", x, 2.0), (x,)


@case(
    "bare-array-where-cache-expected",
    ("torch",),
    di.ContextError,
    r"Argument 5 of jvp is a ndarray, not a context.*di\.Cache\(value\) for scratch",
)
def _(mp):
    x, t, scratch = vec(), np.ones(3), np.zeros(3)
    return lambda: di.jvp(twice, "torch", x, t, scratch), (x, t, scratch)


@case("cache-class-not-instance", (), di.ContextError, r"Argument 4 of hessian is a type, not a context")
def _(mp):
    x = vec()
    return lambda: di.hessian(square_sum, "finite_differences", x, di.Cache), (x,)


@case(
    "constant-string-array-torch",
    ("torch",),
    di.ContextError,
    r"Context 0 \(a di\.Constant\) holds an array of dtype <U3, which the torch backend cannot convert.*tolist",
)
def _(mp):
    x, labels = vec(), di.Constant(np.array(["cat", "dog", "emu"]))
    return lambda: di.gradient(square_sum, "torch", x, labels), (x, labels)


@case(
    "cache-object-array-jax",
    ("jax",),
    di.ContextError,
    r"Context 1 \(a di\.Cache\) holds an array of dtype object, which the jax backend cannot convert",
)
def _(mp):
    x, c, cache = vec(), di.Constant(2.0), di.Cache(np.array([object(), None]))
    return lambda: di.gradient(square_sum, "jax", x, c, cache), (x, c, cache)


# numpy functions under tracing engines
for _backend_id, _engine, _make in (
    ("jax", "jax", lambda: di.AutoJAX()),
    ("jax-nojit", "jax", lambda: di.AutoJAX(jit=False)),
    ("torch", "torch", lambda: di.AutoTorch()),
    ("torch-func", "torch", lambda: di.AutoTorch(mode="func")),
    ("autograd", "autograd", lambda: di.AutoAutograd()),
):

    def _build_np(mp: pytest.MonkeyPatch, make: Callable[[], Any] = _make) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        x = vec()
        return lambda: di.gradient(numpy_f, make(), x), (x,)

    case(
        f"numpy-f-under-{_backend_id}",
        (_engine,),
        di.FrameworkMismatchError,
        rf"f failed under the {_engine} backend: .*numpy.*AutoFiniteDifferences\(\)",
    )(_build_np)


# numpy reductions, which hand the array to its own method (tensor.sum(axis=None, out=None))
for _backend_id, _engine in (("torch", "torch"), ("torch-func", "torch"), ("mlx", "mlx")):

    def _build_reduction(
        mp: pytest.MonkeyPatch, backend: str = _backend_id
    ) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        x = vec()
        return lambda: di.gradient(lambda v: np.sum(v**2) + np.max(v), backend, x), (x,)

    case(
        f"numpy-reduction-under-{_backend_id}",
        (_engine,),
        di.FrameworkMismatchError,
        rf"f failed under the {_engine} backend: f calls numpy on {_engine} .*AutoFiniteDifferences\(\)",
    )(_build_reduction)


# preparations used with other arguments
def _prep_mismatch(part: str) -> Callable[..., Any]:
    def build(mp: pytest.MonkeyPatch) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        x, c = vec(), di.Constant(np.ones(2))
        prep = di.prepare_gradient(square_sum, "finite_differences", x, c)
        f, backend, y, contexts, op = square_sum, "finite_differences", x, (c,), di.gradient
        other_c = c
        if part == "f":
            f = twice
        elif part == "backend":
            backend = di.AutoFiniteDifferences(method="forward")
        elif part == "shape":
            y = np.ones(4)
        elif part == "dtype":
            y = np.ones(3, dtype=np.float32)
        elif part == "structure":
            y = [x]
        elif part == "array-type":
            y = _torch().ones(3, dtype=_torch().float64)
        elif part == "context-count":
            contexts = ()
        elif part == "context-kind":
            other_c = di.Cache(np.ones(2))
            contexts = (other_c,)
        elif part == "context-shape":
            other_c = di.Constant(np.ones(5))
            contexts = (other_c,)
        elif part == "operator":
            op = di.hessian
        return lambda: op(f, backend, y, *contexts, prep=prep), (x, y, c, other_c)

    return build


for _part, _engines, _match in (
    ("f", (), r"f: prepared for square_sum, called with twice.*Prepare again.*strict=False"),
    (
        "backend",
        (),
        r"backend: prepared for AutoFiniteDifferences\(method='central'.*called with AutoFiniteDifferences\(method='forward'",
    ),
    (
        "shape",
        (),
        r"x: prepared for a numpy array of shape \(3,\) and dtype float64, called with a numpy array of shape \(4,\)",
    ),
    ("dtype", (), r"x: prepared for .*dtype float64, called with .*dtype float32"),
    ("structure", (), r"x structure: prepared for PyTreeSpec\(\*\), called with PyTreeSpec\(\[\*\]\)"),
    ("array-type", ("torch",), r"x: prepared for a numpy array .* called with a torch array of shape \(3,\)"),
    ("context-count", (), r"contexts: prepared with 1, called with 0"),
    ("context-kind", (), r"context 0: prepared as Constant, called with Cache"),
    (
        "context-shape",
        (),
        r"context 0: prepared for a numpy array of shape \(2,\).*called with a numpy array of shape \(5,\)",
    ),
    ("operator", (), r"operator: prepared for 'gradient', called with 'hessian'.*di\.prepare_gradient"),
):
    case(f"prep-other-{_part}", _engines, di.PreparationMismatchError, rf"This prep does not fit the call\. {_match}")(
        _prep_mismatch(_part)
    )


@case(
    "prep-other-tangent",
    ("jax",),
    di.PreparationMismatchError,
    r"tangent: prepared for a numpy array of shape \(3,\).*called with a numpy array of shape \(3,\) and dtype float32",
)
def _(mp):
    x, t = vec(), np.ones(3)
    prep = di.prepare_jvp(twice, "jax", x, t)
    t32 = np.ones(3, dtype=np.float32)
    return lambda: di.jvp(twice, "jax", x, t32, prep=prep), (x, t, t32)


@case("prep-not-a-prep", (), di.InvalidInputError, r"prep must come from di\.prepare_gradient\(\.\.\.\), got dict")
def _(mp):
    x = vec()
    return lambda: di.gradient(square_sum, "finite_differences", x, prep={}), (x,)


def test_catalogue_is_large_and_distinct() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 40


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input(bad: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert issubclass(bad.error, di.DiffifaceError)
    need(*bad.engines)
    call, inputs = bad.build(monkeypatch)
    before = snapshot(*inputs)
    copies = copy.deepcopy(inputs) if not any(_holds_object_array(i) for i in inputs) else inputs
    with pytest.raises(bad.error, match=bad.match) as caught:
        call()
    assert isinstance(caught.value, di.DiffifaceError)
    assert snapshot(*inputs) == before
    assert snapshot(*copies) == before


def _holds_object_array(tree: Any) -> bool:
    value = tree.value if isinstance(tree, di.Context) else tree
    return any(isinstance(leaf, np.ndarray) and leaf.dtype.kind == "O" for leaf in optree.tree_leaves(value))


# -- the other halves of the policies ------------------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "dtype"), [("jax", "float16"), ("jax", "bfloat16"), ("torch", "float16"), ("torch", "bfloat16")]
)
def test_half_precision_is_computed_in_its_own_dtype(framework: str, dtype: str) -> None:
    need(framework)
    if framework == "jax":
        jnp = _jnp()
        x = jnp.asarray([0.5, -1.0, 2.0], dtype=getattr(jnp, dtype))
    else:
        torch = _torch()
        x = torch.tensor([0.5, -1.0, 2.0], dtype=getattr(torch, dtype))
    before = snapshot(x)
    grad = di.gradient(lambda x: (x * x).sum(), framework, x)
    assert type(grad) is type(x)
    assert str(grad.dtype).removeprefix("torch.") == dtype
    np.testing.assert_allclose(np.asarray(_as_float64(grad)), [1.0, -2.0, 4.0])
    assert snapshot(x) == before


def _as_float64(array: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return array.to(torch.float64).numpy()
    return np.asarray(array).astype(np.float64)


def test_jax_prep_survives_clear_caches() -> None:
    need("jax")
    import jax

    x, c = vec(), di.Constant(np.array([1.0, 2.0, 3.0]))

    def f(x: Any, c: Any) -> Any:
        return (c * jax.numpy.sin(x)).sum()

    prep = di.prepare_gradient(f, "jax", x, c)
    first = np.asarray(di.gradient(f, "jax", x, c, prep=prep))
    jax.clear_caches()
    again = np.asarray(di.gradient(f, "jax", x, c, prep=prep))
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(again, [1.0, 2.0, 3.0] * np.cos(x))


@pytest.mark.parametrize("backend", [*BACKENDS, "torch-func"])
def test_python_complex_cotangent_of_a_real_output_is_refused(backend: str) -> None:
    # a complex number's imaginary part has no meaning for a real output: autograd and finite
    # differences dropped it, torch and jax failed with their own errors
    need(backend.partition("-")[0])
    x = vec()
    with pytest.raises(
        di.TangentMismatchError, match=r"leaf 0 is a Python complex number.*dtype float64.*Pass a float"
    ):
        di.vjp(square_sum, backend, x, 1 + 2j)
    prep = di.prepare_vjp(square_sum, backend, x, 1.0)
    with pytest.raises(di.PreparationMismatchError, match=r"prepared for a Python float, called with a Python complex"):
        di.vjp(square_sum, backend, x, 1 + 2j, prep=prep)
    np.testing.assert_allclose(di.vjp(square_sum, backend, x, 2.0, prep=prep), 4 * x, rtol=1e-6)


class Boom(ValueError):
    pass


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("operator", ["gradient", "jacobian", "hessian", "jvp", "vjp", "hvp"])
def test_exception_from_f_arrives_unwrapped(backend: str, operator: str) -> None:
    need(backend)
    error = Boom("boom")

    def f(x: Any) -> Any:
        raise error

    x, t = vec(), np.ones(3)
    args = (x, t) if operator in ("jvp", "vjp", "hvp") else (x,)
    before = snapshot(*args)
    with pytest.raises(Boom) as caught:
        getattr(di, operator)(f, backend, *args)
    assert caught.value is error
    assert not isinstance(caught.value, di.DiffifaceError)
    assert snapshot(*args) == before
