"""Sharded jax arrays over 8 simulated CPU devices: every AutoJAX operator keeps the input's
sharding and moves nothing to the host; finite differences and check_gradients work on the
devices; arrays committed to device 3 get results on device 3.

XLA_FLAGS must be set before jax is imported, so the checks run in a subprocess
(tests/sharded/single_process.py), bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="jax is not installed")

SCRIPT = Path(__file__).parent / "sharded" / "single_process.py"
ROOT = Path(__file__).parent.parent


def test_sharded_single_process() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("JAX_ENABLE_X64", None)
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the sharded checks ran past 120 s: {exc.stdout!r}")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert done.returncode == 0, "\n".join(failed) or (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip().endswith("0 failed")
