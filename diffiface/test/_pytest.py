"""pytest integration: backends x scenarios as parameters with readable ids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._adapters import available, install_hint, normalize
from .._backends import Backend
from ._running import backend_label
from ._scenario import Scenario

__all__ = ["parametrize"]


def parametrize(backends: Sequence[Backend | str], scenarios: Iterable[Scenario]) -> Any:
    """A ``pytest.mark.parametrize("backend, scenario", ...)`` over every pair, with ids such as
    ``gradient-vector-constant-float64-jax``; a backend that is not installed is marked skipped
    with the extra that installs it.

    Use it with :func:`~diffiface.test.test_differentiation` on one pair per test::

        @parametrize(["jax", "torch"], core_scenarios())
        def test_core(backend, scenario):
            test_differentiation([backend], [scenario])
    """
    import pytest

    params = []
    for scenario in scenarios:
        for backend in backends:
            backend = normalize(backend)
            label = backend_label(backend)
            marks = (
                []
                if available(backend)
                else [pytest.mark.skip(reason=f"{label} is not installed: {install_hint(backend)}")]
            )
            params.append(pytest.param(backend, scenario, id=f"{scenario.name}-{label}", marks=marks))
    return pytest.mark.parametrize(("backend", "scenario"), params)
