"""Complex scenarios, with analytic references in the convention of ``docs/complex.md``.

Real losses of complex x (gradient, hvp, jvp, vjp): ``sum |z|^2``, ``Re sum z^2 w``,
``sum log(1 + |z|^2)``, a squared residual of a complex linear layer (a pytree with a real leaf
beside the complex ones), the fidelity of a diagonal unitary ``diag(exp(i theta))`` (real x,
complex inside) and of a Cayley unitary of a complex matrix. Holomorphic maps (jacobian,
derivative, jvp, vjp): ``z^2``, ``exp z``, ``A z``. Maps that are not holomorphic (jvp, vjp):
``conj(z) z``, ``Re(z) z``, ``|z| z``.

For a map ``f(z)`` with ``A = df/dz`` and ``B = df/dconj z`` (elementwise here), the references
are ``jvp(v) = A v + B conj(v)`` and ``vjp(w) = conj(A) w + B conj(w)``; a real loss's gradient
``g`` is the vjp of 1, ``df = Re<g, dz>``.

The functions are written once against the numpy API of their input's framework
(``numpy_like``), so they run under jax, torch, autograd and numpy alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _arrays
from .._complex import from_parts
from .._contexts import Constant
from .._tangents import Tangents
from ._scenario import Scenario

__all__ = ["complex_scenarios"]

_DTYPES = {"complex128": np.complex128, "complex64": np.complex64}
_FRAMEWORKS = frozenset({"numpy", "jax", "torch", "autograd", "mlx", "tensorflow"})
"""Written with the numpy-like namespace's functions alone (no array methods), so TensorFlow's
numpy API runs them too; PyTensor refuses complex numbers."""


def _xp(value: Any) -> Any:
    return _arrays.numpy_like(value)


# -- the functions --------------------------------------------------------------------------------------


def abs2_sum(z: Any) -> Any:
    """``sum |z|^2``: gradient ``2 z`` (3+4j -> 6+8j), hvp ``2 v``."""
    xp = _xp(z)
    return xp.sum(xp.abs(z) ** 2)


def re_z2w(z: Any, w: Any) -> Any:
    """``Re sum(z^2 w)``: the real part of a holomorphic ``h``, gradient ``conj(h'(z)) = conj(2 z w)``."""
    xp = _xp(z)
    return xp.sum(xp.real(z * z * w))


def log1p_abs2(z: Any) -> Any:
    """``sum log(1 + |z|^2)``: gradient ``2 z / (1 + |z|^2)``."""
    xp = _xp(z)
    return xp.sum(xp.log(1 + xp.abs(z) ** 2))


def linear_loss(params: dict[str, Any], data: Any, target: Any) -> Any:
    """``scale^2 * sum |W x + b - t|^2`` of a complex linear layer, with a real ``scale``."""
    xp = _xp(params["W"])
    residual = xp.matmul(params["W"], data) + params["b"] - target
    return params["scale"] ** 2 * xp.sum(xp.abs(residual) ** 2)


def phase_fidelity(theta: Any, psi: Any, phi: Any) -> Any:
    """``|<psi, diag(exp(i theta)) phi>|^2``: real x, complex inside."""
    xp = _xp(theta)
    phases = xp.exp(from_parts(xp.zeros_like(theta), theta))  # exp(i theta), without float * complex
    amplitude = xp.sum(xp.conj(psi) * phases * phi)
    return xp.abs(amplitude) ** 2


def cayley_fidelity(m: Any, psi: Any, phi: Any) -> Any:
    """``|<psi, U phi>|^2`` with the unitary ``U = (I + K)^-1 (I - K)``, ``K = M - M^H`` skew-Hermitian."""
    xp = _xp(m)
    k = m - xp.conj(m).T
    eye = xp.eye(m.shape[0], dtype=m.dtype)
    u_phi = xp.linalg.solve(eye + k, xp.matmul(eye - k, phi))
    return xp.abs(xp.sum(xp.conj(psi) * u_phi)) ** 2


def square(z: Any) -> Any:
    return z * z


def exp(z: Any) -> Any:
    return _xp(z).exp(z)


def matvec(z: Any, a: Any) -> Any:
    return _xp(z).matmul(a, z)


def conj_times(z: Any) -> Any:
    """``conj(z) z``: real values in a complex dtype, not holomorphic."""
    return _xp(z).conj(z) * z


def real_times(z: Any) -> Any:
    """``Re(z) z``, the real part as ``(z + conj z) / 2`` (complex: jax's strict promotion takes
    no float * complex)."""
    return (z + _xp(z).conj(z)) / 2 * z


def abs_times(z: Any) -> Any:
    """``|z| z``, the modulus as ``sqrt(conj(z) z)`` (complex, as in :func:`real_times`)."""
    xp = _xp(z)
    return xp.sqrt(xp.conj(z) * z) * z


# -- the scenarios -------------------------------------------------------------------------------------


def complex_scenarios(dtypes: tuple[str, ...] = ("complex128", "complex64")) -> list[Scenario]:
    """The complex scenarios, each in every dtype of ``dtypes``; tagged ``complex``."""
    scenarios: list[Scenario] = []
    for dtype in dtypes:
        scenarios += _for_dtype(dtype)
    return scenarios


def _for_dtype(dtype: str) -> list[Scenario]:
    c = _DTYPES[dtype]
    real = np.float64 if dtype == "complex128" else np.float32
    rng = np.random.default_rng(21)

    def draw(*shape: int) -> np.ndarray:
        return (rng.uniform(-1.5, 1.5, shape) + 1j * rng.uniform(-1.5, 1.5, shape)).astype(c)

    z: np.ndarray = np.array([3 + 4j, 0.5 - 1.25j, -0.75 + 0.25j], dtype=c)
    v = draw(3)  # a tangent of z
    w = draw(3)  # a cotangent of f(z), or a constant
    z_scalar: np.ndarray = np.asarray(1.25 - 0.5j, dtype=c)
    a = draw(2, 3)
    out: list[Scenario] = []
    tags = frozenset({"complex", dtype})

    def add(name: str, f: Callable[..., Any], x: Any, operator: str, reference: Any, **kw: Any) -> None:
        out.append(
            Scenario(
                name=f"complex-{name}-{operator}-{dtype}",
                f=f,
                x=x,
                operator=operator,
                reference=reference,
                tags=tags | kw.pop("extra_tags", frozenset()),
                note="complex: analytic reference in torch's convention (docs/complex.md)",
                frameworks=kw.pop("frameworks", _FRAMEWORKS),
                **kw,
            )
        )

    def real_loss(
        name: str, f: Callable[..., Any], x: Any, value: Any, grad: Any, contexts: tuple[Any, ...] = (), **kw: Any
    ) -> None:
        add(name, f, x, "gradient", grad, contexts=contexts)
        add(name, f, x, "value_and_gradient", (value, grad), contexts=contexts)
        one = np.asarray(1.0, dtype=real)
        add(name, f, x, "vjp", grad, contexts=contexts, tangent=one)
        if "tangent" in kw:  # jvp of a real loss: Re<grad, v>
            tangent = kw["tangent"]
            add(
                name,
                f,
                x,
                "jvp",
                np.asarray(np.real(np.vdot(grad, tangent)), dtype=real),
                contexts=contexts,
                tangent=tangent,
            )
        if "hvp" in kw:
            loose = {} if dtype == "complex128" else {"rtol": 3e-2, "atol": 3e-2}  # second differences in float32
            add(
                name,
                f,
                x,
                "hvp",
                kw["hvp"],
                contexts=contexts,
                tangent=kw["tangent"],
                extra_tags=frozenset({"second_order"}),
                **loose,
            )
            # a batch of two: the hvp is real-linear in the tangent
            half = np.asarray(-0.5, dtype=real)
            add(
                name,
                f,
                x,
                "batched_hvp",
                Tangents(kw["hvp"], (half * kw["hvp"]).astype(c)),
                contexts=contexts,
                tangent=Tangents(kw["tangent"], (half * kw["tangent"]).astype(c)),
                extra_tags=frozenset({"second_order"}),
                **loose,
            )

    # real losses of complex x
    real_loss("abs2", abs2_sum, z, np.asarray(np.sum(np.abs(z) ** 2), dtype=real), 2 * z, tangent=v, hvp=2 * v)
    wc = Constant(w)
    real_loss(
        "re_z2w",
        re_z2w,
        z,
        np.asarray(np.real(np.sum(z * z * w)), dtype=real),
        np.conj(2 * z * w).astype(c),
        (wc,),
        tangent=v,
        hvp=np.conj(2 * w * v).astype(c),
    )
    denom = 1 + np.abs(z) ** 2
    real_loss(
        "log1p_abs2",
        log1p_abs2,
        z,
        np.asarray(np.sum(np.log(denom)), dtype=real),
        (2 * z / denom).astype(c),
        tangent=v,
        hvp=(2 * v / denom - 2 * z * (2 * np.real(np.conj(z) * v)) / denom**2).astype(c),
    )
    params = {"W": draw(2, 3), "b": draw(2), "scale": np.asarray(0.75, dtype=real)}
    data, target = draw(3), draw(2)
    residual = params["W"] @ data + params["b"] - target
    s = params["scale"]
    grads = {
        "W": (s**2 * 2 * np.outer(residual, np.conj(data))).astype(c),
        "b": (s**2 * 2 * residual).astype(c),
        "scale": np.asarray(2 * s * np.sum(np.abs(residual) ** 2), dtype=real),
    }
    value = np.asarray(s**2 * np.sum(np.abs(residual) ** 2), dtype=real)
    real_loss("linear_layer", linear_loss, params, value, grads, (Constant(data), Constant(target)))
    theta: np.ndarray = np.array([0.3, -1.1, 2.0], dtype=real)
    psi, phi = draw(3), draw(3)
    terms = np.conj(psi) * np.exp(1j * theta) * phi
    amplitude = terms.sum()
    real_loss(
        "phase_unitary",
        phase_fidelity,
        theta,
        np.asarray(np.abs(amplitude) ** 2, dtype=real),
        (2 * np.real(np.conj(amplitude) * 1j * terms)).astype(real),
        (Constant(psi), Constant(phi)),
    )
    if dtype == "complex128":  # by central differences in complex128: no analytic form at hand
        m = 0.3 * draw(3, 3)
        add(
            "cayley_unitary",
            cayley_fidelity,
            m,
            "gradient",
            _cayley_gradient(m, psi, phi),
            contexts=(Constant(psi), Constant(phi)),
            frameworks=_FRAMEWORKS - {"tensorflow"},  # (a solve: TensorFlow's numpy API has no linalg)
        )

    # holomorphic maps
    add("square", square, z, "jacobian", np.diag(2 * z).astype(c))
    add("exp", exp, z, "jacobian", np.diag(np.exp(z)).astype(c))
    add("matvec", matvec, z, "jacobian", a, contexts=(Constant(a),))
    add("square", square, z_scalar, "derivative", (2 * z_scalar).astype(c))
    add("exp", exp, z_scalar, "value_and_derivative", (np.exp(z_scalar).astype(c), np.exp(z_scalar).astype(c)))
    add("square", square, z, "jvp", (2 * z * v).astype(c), tangent=v)
    add("square", square, z, "vjp", (np.conj(2 * z) * w).astype(c), tangent=w)
    add("matvec", matvec, z, "vjp", (np.conj(a).T @ w[:2]).astype(c), contexts=(Constant(a),), tangent=w[:2])

    # maps that are not holomorphic: jvp = A v + B conj(v), vjp = conj(A) w + B conj(w)
    for name, f, da, db in (
        ("conj_times", conj_times, np.conj(z), z),
        ("real_times", real_times, z + np.conj(z) / 2, z / 2),
        ("abs_times", abs_times, 1.5 * np.abs(z), z * z / (2 * np.abs(z))),
    ):
        add(name, f, z, "jvp", (da * v + db * np.conj(v)).astype(c), tangent=v)
        add(name, f, z, "vjp", (np.conj(da) * w + db * np.conj(w)).astype(c), tangent=w)
    return out


def _cayley_gradient(m: np.ndarray, psi: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """The gradient of :func:`cayley_fidelity` in closed form.

    With ``S = I + K``, ``u = S^-1 (I - K) phi``, ``a = <psi, u>`` and ``L = |a|^2``:
    ``du = -S^-1 dK (phi + u)``, so ``dL = 2 Re(conj(a) <psi, du>) = Re<G_K, dK>`` with
    ``G_K = -2 a (S^-H psi)(phi + u)^H``; ``dK = dM - dM^H`` gives ``G = G_K - G_K^H``.
    """
    k = m - np.conj(m).T
    eye = np.eye(m.shape[0], dtype=m.dtype)
    s = eye + k
    u = np.linalg.solve(s, (eye - k) @ phi)
    a = np.vdot(psi, u)
    left = np.linalg.solve(np.conj(s).T, psi)
    g_k = -2 * a * np.outer(left, np.conj(phi + u))
    gradient: np.ndarray = (g_k - np.conj(g_k).T).astype(m.dtype)
    return gradient
