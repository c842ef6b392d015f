"""Models bigger than one device, torch half: DTensor parameters sharded over a 2-process gloo
group on CPU. The group is started once for the module (two subprocesses running
tests/sharded_torch/worker.py, which runs every case of tests/sharded_torch/cases.py), bounded
in time and ended here, also on failure; each case is then one test. Devices: results stay on
the input's device and dtype on every backend that takes torch tensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import diffiface as di

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

HERE = Path(__file__).parent / "sharded_torch"
WORLD = 2
TIMEOUT_S = 120
"""The whole group's bound: the cases take about 5 s on 2 cores."""


def _case_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("sharded_torch_cases", HERE / "cases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CASES)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case's outcome on each rank, from one run of the 2-process group."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch was built without torch.distributed's gloo backend")
    out = tmp_path_factory.mktemp("sharded_torch")
    port = str(_free_port())
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    processes = [
        subprocess.Popen(
            [sys.executable, str(HERE / "worker.py"), str(rank), str(WORLD), port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for process in processes:
            try:
                logs.append(process.communicate(timeout=TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {WORLD}-process group did not finish within {TIMEOUT_S} s")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    results = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results:\n{logs[rank][-3000:] if rank < len(logs) else ''}"
        results.append(json.loads(path.read_text()))
    return results


@pytest.mark.parametrize("name", _case_names())
def test_sharded_case(outcomes: list[dict[str, Any]], name: str) -> None:
    for rank, results in enumerate(outcomes):
        result = results[name]
        assert result["ok"], f"rank {rank}:\n{result['error']}"


# -- devices: results on the input's device and dtype --------------------------------------------

TORCH_BACKENDS = {
    "torch-autograd": di.AutoTorch(),
    "torch-func": di.AutoTorch(mode="func"),
    "finite_differences": di.AutoFiniteDifferences(),
    "scipy": di.AutoScipy(),
}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def _loss(x: Any, c: Any) -> Any:
    return (c * torch.sin(x)).sum()


def _outputs(x: Any, c: Any) -> Any:
    return c * torch.sin(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend", list(TORCH_BACKENDS.values()), ids=list(TORCH_BACKENDS))
def test_results_stay_on_the_input_device_and_dtype(backend: di.Backend, dtype: Any, device: str) -> None:
    if isinstance(backend, di.AutoScipy) and not di.available(backend):
        pytest.skip("scipy is not installed")
    x = torch.linspace(0.1, 1.0, 5, dtype=dtype, device=device)
    c = di.Constant(torch.full((5,), 2.0, dtype=dtype, device=device))
    t = torch.ones(5, dtype=dtype, device=device)
    expected = 2 * torch.cos(x.double().cpu())
    results = {
        "gradient": di.gradient(_loss, backend, x, c),
        "value_and_gradient": di.value_and_gradient(_loss, backend, x, c)[1],
        "jvp": di.jvp(_outputs, backend, x, t, c),
        "vjp": di.vjp(_outputs, backend, x, t, c),
    }
    for name, result in results.items():
        assert isinstance(result, torch.Tensor), name
        assert result.device == x.device and result.dtype == dtype, (name, result.device, result.dtype)
        differences = isinstance(backend, (di.AutoFiniteDifferences, di.AutoScipy))
        tol = (2e-3 if differences else 1e-5) if dtype == torch.float32 else 1e-6
        np.testing.assert_allclose(result.double().cpu().numpy(), expected.numpy(), rtol=tol, atol=tol)
    value = di.value_and_gradient(_loss, backend, x, c)[0]
    assert value.device == x.device and value.dtype == dtype


@pytest.mark.parametrize("backend", list(TORCH_BACKENDS.values()), ids=list(TORCH_BACKENDS))
def test_a_meta_tensor_is_refused(backend: di.Backend) -> None:
    if isinstance(backend, di.AutoScipy) and not di.available(backend):
        pytest.skip("scipy is not installed")
    x = torch.zeros(5, device="meta")
    with pytest.raises(di.DiffifaceError, match="meta"):
        di.gradient(lambda x: x.sum(), backend, x)
