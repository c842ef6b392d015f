"""diffiface: one API to differentiate a Python function with any automatic-differentiation
engine (jax, torch, autograd, finite differences, scipy), and a test suite that proves each
engine gives the right derivatives.

>>> import numpy as np, diffiface as di
>>> di.gradient(lambda x, c: (c * x**2).sum(), "finite_differences", np.ones(3), di.Constant(2.0)).round(6)
array([4., 4., 4.])

Importing diffiface imports no array framework; each engine is imported on first use.
"""

from . import _sparse_operators  # noqa: F401  (registers AutoSparse's program with the route)
from . import sparse as sparse
from . import tree as tree
from ._adapters import PublicSecondOrder as SecondOrder
from ._adapters import available as available
from ._backends import AutoAutograd as AutoAutograd
from ._backends import AutoFiniteDifferences as AutoFiniteDifferences
from ._backends import AutoJAX as AutoJAX
from ._backends import AutoMLX as AutoMLX
from ._backends import AutoPyTensor as AutoPyTensor
from ._backends import AutoScipy as AutoScipy
from ._backends import AutoTensorFlow as AutoTensorFlow
from ._backends import AutoTorch as AutoTorch
from ._backends import Backend as Backend
from ._batched import batched_hvp as batched_hvp
from ._batched import batched_jvp as batched_jvp
from ._batched import batched_vjp as batched_vjp
from ._batched import gradient_and_batched_hvp as gradient_and_batched_hvp
from ._batched import prepare_batched_hvp as prepare_batched_hvp
from ._batched import prepare_batched_jvp as prepare_batched_jvp
from ._batched import prepare_batched_vjp as prepare_batched_vjp
from ._batched import prepare_gradient_and_batched_hvp as prepare_gradient_and_batched_hvp
from ._batched import prepare_value_and_batched_jvp as prepare_value_and_batched_jvp
from ._batched import prepare_value_and_batched_vjp as prepare_value_and_batched_vjp
from ._batched import value_and_batched_jvp as value_and_batched_jvp
from ._batched import value_and_batched_vjp as value_and_batched_vjp
from ._bridges import DifferentiateWith as DifferentiateWith
from ._bridges import differentiate_with as differentiate_with
from ._contexts import Cache as Cache
from ._contexts import Constant as Constant
from ._contexts import Context as Context
from ._errors import ArrayTypeError as ArrayTypeError
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import ContextError as ContextError
from ._errors import DiffifaceError as DiffifaceError
from ._errors import FrameworkMismatchError as FrameworkMismatchError
from ._errors import GradientCheckError as GradientCheckError
from ._errors import InputTooLargeError as InputTooLargeError
from ._errors import InvalidBackendOptionError as InvalidBackendOptionError
from ._errors import InvalidInputError as InvalidInputError
from ._errors import InvalidOptionError as InvalidOptionError
from ._errors import InvalidOutputError as InvalidOutputError
from ._errors import MutationError as MutationError
from ._errors import PreparationMismatchError as PreparationMismatchError
from ._errors import TangentMismatchError as TangentMismatchError
from ._errors import UnknownBackendError as UnknownBackendError
from ._errors import UnsupportedOperationError as UnsupportedOperationError
from ._operators import derivative as derivative
from ._operators import gradient as gradient
from ._operators import gradient_and_hvp as gradient_and_hvp
from ._operators import hessian as hessian
from ._operators import hvp as hvp
from ._operators import jacobian as jacobian
from ._operators import jvp as jvp
from ._operators import prepare_derivative as prepare_derivative
from ._operators import prepare_gradient as prepare_gradient
from ._operators import prepare_gradient_and_hvp as prepare_gradient_and_hvp
from ._operators import prepare_hessian as prepare_hessian
from ._operators import prepare_hvp as prepare_hvp
from ._operators import prepare_jacobian as prepare_jacobian
from ._operators import prepare_jvp as prepare_jvp
from ._operators import prepare_second_derivative as prepare_second_derivative
from ._operators import prepare_value_and_derivative as prepare_value_and_derivative
from ._operators import prepare_value_and_gradient as prepare_value_and_gradient
from ._operators import prepare_value_and_jacobian as prepare_value_and_jacobian
from ._operators import prepare_value_and_jvp as prepare_value_and_jvp
from ._operators import prepare_value_and_vjp as prepare_value_and_vjp
from ._operators import prepare_value_derivative_and_second_derivative as prepare_value_derivative_and_second_derivative
from ._operators import prepare_value_gradient_and_hessian as prepare_value_gradient_and_hessian
from ._operators import prepare_vjp as prepare_vjp
from ._operators import second_derivative as second_derivative
from ._operators import value_and_derivative as value_and_derivative
from ._operators import value_and_gradient as value_and_gradient
from ._operators import value_and_jacobian as value_and_jacobian
from ._operators import value_and_jvp as value_and_jvp
from ._operators import value_and_vjp as value_and_vjp
from ._operators import value_derivative_and_second_derivative as value_derivative_and_second_derivative
from ._operators import value_gradient_and_hessian as value_gradient_and_hessian
from ._operators import vjp as vjp
from ._prep import Prep as Prep
from ._sparse_operators import AutoSparse as AutoSparse
from ._tangents import Tangents as Tangents
from ._torch_module import functional as functional

__version__ = "0.1.0"

__all__ = [
    # backends
    "AutoAutograd",
    "AutoFiniteDifferences",
    "AutoJAX",
    "AutoPyTensor",
    "AutoMLX",
    "AutoScipy",
    "AutoSparse",
    "AutoTensorFlow",
    "AutoTorch",
    "Backend",
    "SecondOrder",
    "available",
    # contexts
    "Cache",
    "Constant",
    "Context",
    # frameworks' models
    "functional",
    # one engine's function inside another engine's differentiation
    "differentiate_with",
    "DifferentiateWith",
    # first-order operators
    "derivative",
    "value_and_derivative",
    "gradient",
    "value_and_gradient",
    "jacobian",
    "value_and_jacobian",
    "jvp",
    "value_and_jvp",
    "vjp",
    "value_and_vjp",
    # batches of products
    "Tangents",
    "batched_jvp",
    "value_and_batched_jvp",
    "batched_vjp",
    "value_and_batched_vjp",
    "batched_hvp",
    "gradient_and_batched_hvp",
    # second-order operators
    "second_derivative",
    "value_derivative_and_second_derivative",
    "hessian",
    "value_gradient_and_hessian",
    "hvp",
    "gradient_and_hvp",
    # preparation
    "Prep",
    "prepare_derivative",
    "prepare_value_and_derivative",
    "prepare_gradient",
    "prepare_value_and_gradient",
    "prepare_jacobian",
    "prepare_value_and_jacobian",
    "prepare_jvp",
    "prepare_value_and_jvp",
    "prepare_vjp",
    "prepare_value_and_vjp",
    "prepare_batched_jvp",
    "prepare_value_and_batched_jvp",
    "prepare_batched_vjp",
    "prepare_value_and_batched_vjp",
    "prepare_batched_hvp",
    "prepare_gradient_and_batched_hvp",
    "prepare_second_derivative",
    "prepare_value_derivative_and_second_derivative",
    "prepare_hessian",
    "prepare_value_gradient_and_hessian",
    "prepare_hvp",
    "prepare_gradient_and_hvp",
    # errors
    "DiffifaceError",
    "ArrayTypeError",
    "BackendUnavailableError",
    "ContextError",
    "FrameworkMismatchError",
    "GradientCheckError",
    "InputTooLargeError",
    "InvalidBackendOptionError",
    "InvalidInputError",
    "InvalidOptionError",
    "InvalidOutputError",
    "MutationError",
    "PreparationMismatchError",
    "TangentMismatchError",
    "UnknownBackendError",
    "UnsupportedOperationError",
    # pytrees
    "tree",
]
