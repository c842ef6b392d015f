"""One row of the registry (:mod:`diffiface._adapters`): what the registry and each adapter know
of a backend."""

from __future__ import annotations

from dataclasses import dataclass

from .._backends import Backend


@dataclass(frozen=True)
class BackendInfo:
    """One row of the registry."""

    name: str
    config: type[Backend]
    module: str
    requires: tuple[str, ...]
    extra: str | None
    forward_mode: bool
    reverse_mode: bool
    native: frozenset[str]
    """Operators the adapter computes itself (the methods it overrides); the others are derived
    in ``_base``. tests/test_backends.py compares this with each adapter's methods."""
    arrays: str = "numpy"
    """The arrays the engine differentiates and calls ``f`` with: ``"jax"``, ``"torch"``,
    ``"numpy"`` (autograd traces numpy code), or ``"any"`` (the input's own array type,
    whatever framework it is: the black-box engines)."""
    complex_convention: str = "split"
    """How the engine differentiates complex numbers (diffiface._complex converts, once):
    ``"direct"``, its gradient and vjp are the convention already (torch's); ``"conjugate"``, its gradient
    is the conjugate and its vjp ``conj(vjp(conj(ybar)))`` of the convention's (jax, autograd);
    ``"split"``, it differentiates real numbers only and sees a complex leaf as its real and
    imaginary parts (the black boxes)."""
    jit: bool = False
    float64_precision: str = "float64"
    """The dtype whose precision the engine's float64 results have: ``"float32"`` where its
    float64 functions are accurate to float32 only (mlx's sin, cos, exp); the checker of
    diffiface.test sets its tolerances from it."""
    complex_second_order: str = ""
    """Why the engine's second derivatives of a complex x (hvp) cannot be trusted, where they
    cannot ("": they can): such calls are refused with this reason (diffiface._complex)."""
    reverse_first: bool = False
    """Whether its reverse products cost less than its forward ones (autograd's forward mode
    is two reverse passes; torch's runs decompositions): a sparse Jacobian takes rows on a tie."""

    @property
    def any_array_type(self) -> bool:
        """True when ``f`` is called with the input's own array type, whatever framework it is."""
        return self.arrays == "any"
