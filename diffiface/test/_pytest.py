"""pytest integration: backends x scenarios as parameters with readable ids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._adapters import normalize
from .._backends import Backend
from ._running import backend_label, skip_reason
from ._scenario import Scenario

__all__ = ["parametrize"]


def parametrize(backends: Sequence[Backend | str], scenarios: Iterable[Scenario]) -> Any:
    """A ``pytest.mark.parametrize("backend, scenario", ...)`` over every pair, with ids such as
    ``gradient-vector-constant-float64-jax``; a pair that cannot be checked is marked skipped
    with the reason (a backend that is not installed, with the extra that installs it; f written
    for another framework), as test_differentiation refuses a call that checks nothing.

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
            reason = skip_reason(backend, scenario, label, None)
            marks = [] if reason is None else [pytest.mark.skip(reason=reason)]
            params.append(pytest.param(backend, scenario, id=f"{scenario.name}-{label}", marks=marks))
    return pytest.mark.parametrize(("backend", "scenario"), params)
