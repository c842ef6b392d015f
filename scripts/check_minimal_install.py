"""Run by .ci/run in an environment holding only diffiface's required dependencies.

Finite differences must work; every other backend must report itself unavailable, naming the
extra that installs it; the main job must run and pass on what is installed.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import diffiface as di

missing = [name for name in ("jax", "torch", "autograd", "scipy") if di.available(name)]
assert not missing, f"this check needs an environment without {missing}"

gradient = di.gradient(lambda x: (x**2).sum(), "finite_differences", np.array([1.0, 2.0]))
assert np.allclose(gradient, [2.0, 4.0], atol=1e-6), gradient

for name, extra in (("jax", "jax"), ("torch", "torch"), ("autograd", "autograd"), ("scipy", "scipy")):
    try:
        di.gradient(lambda x: (x**2).sum(), name, np.ones(2))
    except di.BackendUnavailableError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{name} ran although it is not installed")
    if f'pip install "diffiface[{extra}]"' not in message:
        raise AssertionError(f"the {name} error does not name its extra: {message}")

job = subprocess.run(
    [sys.executable, "-m", "diffiface.test", "--quick", "--no-progress"], capture_output=True, text=True, check=False
)
print(job.stdout)
assert job.returncode == 0, job.stdout + job.stderr
for extra in ("jax", "torch", "autograd", "scipy"):
    assert f'pip install "diffiface[{extra}]"' in job.stdout, f"the main job does not name the {extra} extra"
print("minimal install: finite differences work, every other backend names its extra")
