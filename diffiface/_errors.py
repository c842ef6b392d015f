"""Every exception diffiface raises; each derives from :class:`DiffifaceError`.

Where a standard exception fits the fault too (a wrong type, a wrong value, a missing
module), the class also derives from it, so ``except TypeError`` keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArrayTypeError",
    "BackendUnavailableError",
    "ContextError",
    "DiffifaceError",
    "FrameworkMismatchError",
    "GradientCheckError",
    "InvalidBackendOptionError",
    "InvalidInputError",
    "InvalidOptionError",
    "InputTooLargeError",
    "InvalidOutputError",
    "MutationError",
    "PreparationMismatchError",
    "TangentMismatchError",
    "UnknownBackendError",
    "UnsupportedOperationError",
]


class DiffifaceError(Exception):
    """Base class of every error raised by diffiface itself."""


class UnknownBackendError(DiffifaceError, ValueError):
    """A backend name or object that diffiface does not know."""


class BackendUnavailableError(DiffifaceError, ImportError):
    """The engine behind a backend is not installed; the message names the extra to install."""


class InvalidBackendOptionError(DiffifaceError, ValueError):
    """A backend option with a value the backend cannot use (say, an unknown finite-difference method)."""


class InvalidOptionError(DiffifaceError, ValueError):
    """An option of a diffiface function with a value it cannot take (say,
    ``check_gradients(projections=-2)``); the message names the option and what it takes."""


class ContextError(DiffifaceError, TypeError):
    """An extra argument that is not wrapped in :class:`~diffiface.Constant` or :class:`~diffiface.Cache`."""


class InvalidInputError(DiffifaceError, TypeError):
    """A differentiated input that cannot be differentiated (integer, bool, string, wrong rank...)."""


class ArrayTypeError(DiffifaceError, TypeError):
    """Arrays of several frameworks mixed in one input, or an array the backend cannot take."""


class InvalidOutputError(DiffifaceError, ValueError):
    """``f`` returned something the operator cannot use (not a scalar, not numeric...)."""


class TangentMismatchError(DiffifaceError, ValueError):
    """A tangent or cotangent whose structure, shape or dtype does not fit ``x`` or ``f(x)``."""


class PreparationMismatchError(DiffifaceError, ValueError):
    """A ``prep`` used with arguments other than those it was prepared for."""


class FrameworkMismatchError(DiffifaceError, TypeError):
    """``f`` failed in a way that shows it was written for another framework than the backend's."""


class UnsupportedOperationError(DiffifaceError, NotImplementedError):
    """An operation that this backend, or this combination of backends, cannot do."""


class MutationError(DiffifaceError, RuntimeError):
    """``f`` wrote into an array it must only read: ``x``, a tangent, or a
    :class:`~diffiface.Constant`. The message names which one and what to do instead."""


class InputTooLargeError(DiffifaceError, ValueError):
    """An input too large for the method asked for (finite differences of millions of inputs);
    the message names the limit and the way out."""


class GradientCheckError(DiffifaceError, AssertionError):
    """:func:`diffiface.test.check_gradients` found a wrong gradient (or a check it could not
    pass). An ``AssertionError``, so a test that calls it fails as any assertion does; its
    message is the report's summary, and :attr:`report` the whole :class:`~diffiface.test.Report`."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report
