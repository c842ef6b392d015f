"""Importing diffiface is free: no array framework is imported until a backend is used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FRAMEWORKS = ("torch", "jax", "autograd", "scipy", "array_api_compat")


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_imports_no_framework() -> None:
    out = _run(
        f"""
        import sys
        import diffiface
        import diffiface.tree
        print(sorted(name for name in {FRAMEWORKS!r} if name in sys.modules))
        """
    )
    assert out.strip() == "[]"


def test_finite_differences_on_numpy_imports_no_framework() -> None:
    out = _run(
        f"""
        import sys
        import numpy as np
        import diffiface as di
        g = di.gradient(lambda x, c: (c * x**2).sum(), "finite_differences", np.ones(3), di.Constant(2.0))
        assert np.allclose(g, 4.0), g
        h = di.hessian(lambda x: (x**3).sum(), di.AutoFiniteDifferences(), np.ones(2))
        di.jvp(lambda x: x**2, "finite_differences", np.ones(2), np.ones(2))
        di.available("jax"), di.available("torch")  # checking is not importing
        print(sorted(name for name in {FRAMEWORKS!r} if name in sys.modules))
        """
    )
    assert out.strip() == "[]"


def test_backend_objects_import_nothing() -> None:
    out = _run(
        f"""
        import sys
        import diffiface as di
        backends = [di.AutoJAX(), di.AutoTorch(mode="func"), di.AutoAutograd(), di.AutoScipy(),
                    di.SecondOrder(di.AutoFiniteDifferences(), di.AutoJAX())]
        print(sorted(name for name in {FRAMEWORKS!r} if name in sys.modules))
        """
    )
    assert out.strip() == "[]"
