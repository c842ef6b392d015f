"""diffiface.test: the scenario suite that proves each engine gives the right derivatives.

- :class:`Scenario` and the bundled lists :func:`core_scenarios`, :func:`layer_scenarios`
  (the layer zoo, written once against the array API) and :func:`torch_module_scenarios`;
- :func:`complex_scenarios` (complex inputs and outputs, with analytic references in torch's
  convention: see docs/complex.md);
- :func:`sparse_scenarios` (sparse Jacobians and Hessians with analytic references and
  patterns) and :func:`run_sparse`, which runs them on AutoSparse of each engine and detector;
- :func:`test_differentiation`: every backend on every scenario, against its reference;
- :func:`check_gradients`: one call for a layer author;
- :func:`assert_allclose`: the definition of "the right derivative";
- ``python -m diffiface.test``: the main job, on every installed backend.
"""

from .._errors import GradientCheckError as GradientCheckError
from ._benchmark import benchmark_differentiation as benchmark_differentiation
from ._checking import check_gradients as check_gradients
from ._compare import assert_allclose as assert_allclose
from ._compare import default_tolerances as default_tolerances
from ._complex_scenarios import complex_scenarios as complex_scenarios
from ._pytest import parametrize as parametrize
from ._running import Report as Report
from ._running import Row as Row
from ._running import backend_label as backend_label
from ._running import test_differentiation as test_differentiation
from ._scenario import Scenario as Scenario
from ._scenarios import core_scenarios as core_scenarios
from ._scenarios import layer_scenarios as layer_scenarios
from ._scenarios import torch_module_scenarios as torch_module_scenarios
from ._sparse_scenarios import SparseScenario as SparseScenario
from ._sparse_scenarios import run_sparse as run_sparse
from ._sparse_scenarios import sparse_backends as sparse_backends
from ._sparse_scenarios import sparse_scenarios as sparse_scenarios

__all__ = [
    "GradientCheckError",
    "Report",
    "Row",
    "Scenario",
    "SparseScenario",
    "assert_allclose",
    "backend_label",
    "benchmark_differentiation",
    "check_gradients",
    "complex_scenarios",
    "core_scenarios",
    "default_tolerances",
    "layer_scenarios",
    "parametrize",
    "run_sparse",
    "sparse_backends",
    "sparse_scenarios",
    "test_differentiation",
    "torch_module_scenarios",
]
