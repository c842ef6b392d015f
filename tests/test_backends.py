"""Backend objects, string names, options, and what happens when an engine is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import diffiface as di
import diffiface._adapters as registry

NAMES = {
    "jax": di.AutoJAX(),
    "torch": di.AutoTorch(),
    "autograd": di.AutoAutograd(),
    "finite_differences": di.AutoFiniteDifferences(),
    "scipy": di.AutoScipy(),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_string_names(name: str) -> None:
    backend = registry.normalize(name)
    assert backend == NAMES[name]
    assert backend.name == name
    assert registry.normalize(backend) is backend


def test_defaults() -> None:
    assert di.AutoTorch().mode == "autograd"
    assert di.AutoJAX().jit is True
    assert di.AutoFiniteDifferences().method == "central"
    assert di.AutoFiniteDifferences().step is None
    assert di.AutoFiniteDifferences().black_box
    assert di.AutoScipy().black_box
    assert not di.AutoJAX().black_box
    assert hash(di.AutoTorch(mode="func")) == hash(di.AutoTorch(mode="func"))


def test_unknown_name_lists_the_names() -> None:
    with pytest.raises(di.UnknownBackendError) as info:
        di.gradient(lambda x: x, "theano", 1.0)
    for name in NAMES:
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="theano"):  # also a ValueError
        registry.normalize("theano")
    with pytest.raises(di.UnknownBackendError):
        registry.normalize(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: di.AutoFiniteDifferences(method="bogus"), "bogus"),
        (lambda: di.AutoFiniteDifferences(step=-1), "step"),
        (lambda: di.AutoFiniteDifferences(step=0.0), "step"),
        (lambda: di.AutoFiniteDifferences(step=float("nan")), "step"),
        (lambda: di.AutoTorch(mode="x"), "mode"),
        (lambda: di.AutoScipy(order=3), "order"),
        (lambda: di.AutoScipy(maxiter=0), "maxiter"),
        (lambda: di.AutoJAX(jit="yes"), "jit"),
        (lambda: di.SecondOrder(di.AutoJAX(), 3), "inner"),
        (lambda: di.SecondOrder(di.SecondOrder(di.AutoJAX(), di.AutoJAX()), di.AutoJAX()), "outer"),
    ],
    ids=[
        "method",
        "negative-step",
        "zero-step",
        "nan-step",
        "torch-mode",
        "scipy-order",
        "scipy-maxiter",
        "jit",
        "inner",
        "nested",
    ],
)
def test_invalid_options(make: object, match: str) -> None:
    with pytest.raises(di.InvalidBackendOptionError, match=match):
        make()  # type: ignore[operator]


def test_second_order_that_cannot_trace() -> None:
    with pytest.raises(di.UnsupportedOperationError, match="jax cannot trace through torch"):
        di.SecondOrder(di.AutoJAX(), di.AutoTorch())
    with pytest.raises(NotImplementedError):
        di.SecondOrder(di.AutoTorch(), di.AutoAutograd())
    # a black box outside any engine is fine
    di.SecondOrder(di.AutoFiniteDifferences(), di.AutoTorch())
    di.SecondOrder(di.AutoScipy(), di.AutoJAX())


def test_available_checks_without_importing() -> None:
    assert di.available("finite_differences")
    assert di.available(di.SecondOrder(di.AutoFiniteDifferences(), di.AutoFiniteDifferences()))


def test_missing_engine_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry row whose engine module does not exist, as on a machine without jax."""
    rows = tuple(
        registry.BackendInfo(**{**row.__dict__, "requires": ("diffiface_no_such_module",)})
        if row.name == "jax"
        else row
        for row in registry.BACKENDS
    )
    monkeypatch.setattr(registry, "BACKENDS", rows)
    monkeypatch.setattr(registry, "_BY_CONFIG", {row.config: row for row in rows})
    monkeypatch.setattr(registry, "_BY_NAME", {row.name: row for row in rows})
    monkeypatch.setattr(registry, "_adapters", {})
    assert not di.available("jax")
    with pytest.raises(di.BackendUnavailableError, match=r'pip install "diffiface\[jax\]"'):
        di.gradient(lambda x: x**2, di.AutoJAX(jit=False), np.ones(()))
    with pytest.raises(ImportError):  # also an ImportError
        di.gradient(lambda x: x**2, di.AutoJAX(jit=False), np.ones(()))


def test_missing_engine_in_a_fresh_process() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # importing torch now fails, as if it were not installed
        import numpy as np
        import diffiface as di
        try:
            di.gradient(lambda x: (x**2).sum(), "torch", np.ones(2))
        except di.BackendUnavailableError as exc:
            print(exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert 'pip install "diffiface[torch]"' in result.stdout
    assert "torch" in result.stdout


def test_second_order_adapter_made_first_in_a_fresh_process() -> None:
    """Making a SecondOrder adapter makes its outer and inner ones under the registry's lock:
    it must not wait on itself when neither was made before."""
    code = textwrap.dedent(
        """
        import numpy as np
        import diffiface as di
        backend = di.SecondOrder(di.AutoFiniteDifferences(), di.AutoFiniteDifferences(method="complex"))
        hessian = di.hessian(lambda x: (x**3).sum(), backend, np.ones(2))
        print(np.allclose(hessian, [[6.0, 0.0], [0.0, 6.0]], atol=1e-2))  # nested differences: rough
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


_METHODS = {
    "pullback_function": "pullback",
    "value_and_pullback": "pullback",
    "value_and_pushforward": "pushforward",
    "value_and_gradient": "gradient",
    "value_and_jacobian": "jacobian",
    "value_gradient_and_hessian": "hessian",
    "gradient_and_hvp": "hvp",
    "gradient_and_hvps": "hvp",  # (an engine with its own hvp has its own batch of them)
    "value_and_derivative": "derivative",
    "value_derivative_and_second_derivative": "second_derivative",
}


def test_each_row_is_named_as_its_config() -> None:
    """A config's ``name`` is the registry's key for its engine (the messages name it so)."""
    assert [row.config.name for row in registry.BACKENDS] == [row.name for row in registry.BACKENDS]


@pytest.mark.parametrize("row", registry.BACKENDS, ids=[row.name for row in registry.BACKENDS])
def test_the_registry_says_what_each_adapter_computes_itself(row: Any) -> None:
    """The registry's ``native`` column (which feeds the docs' support matrix) names exactly
    the operators whose methods the engine's adapter overrides: it cannot drift."""
    if not di.available(row.config()):
        pytest.skip(f"{row.name} is not installed")
    import importlib

    from diffiface._adapters._base import Adapter as BaseAdapter

    adapter = importlib.import_module(row.module).Adapter
    overridden = {
        operator
        for method, operator in _METHODS.items()
        if getattr(adapter, method, None) is not getattr(BaseAdapter, method, None)
    }
    assert overridden == set(row.native)


def test_second_order_takes_backend_names() -> None:
    """Every backend may be given by name: SecondOrder refused 'torch' and 'torch-func'."""
    assert di.SecondOrder("finite_differences", "autograd") == di.SecondOrder(
        di.AutoFiniteDifferences(), di.AutoAutograd()
    )
    assert repr(di.SecondOrder("finite_differences", "autograd")).startswith("SecondOrder(")
    with pytest.raises(di.UnknownBackendError):
        di.SecondOrder("no such engine", "autograd")
