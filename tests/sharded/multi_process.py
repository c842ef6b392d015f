"""One of two processes holding a model sharded across both (4 simulated CPU devices each, a
2 x 4 mesh over the 8): ``di.gradient`` and ``check_gradients`` give what one process gives.

Started twice by tests/test_sharded_jax.py: ``multi_process.py <process id> <port>``. Prints
``FAILED ...`` lines and exits non-zero on failure."""

from __future__ import annotations

import os
import sys

# (on a loaded machine of few cores a simulated device's thread may come late to a collective:
# XLA's CPU rendezvous would abort the process after 40 s; it waits as long as the test's bound.
# Eigen's multithreaded pool off, as in single_process.py, where an eager op's all-reduce now and
# then hung with it on)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    " --xla_force_host_platform_device_count=4"
    " --xla_cpu_multi_thread_eigen=false"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
    " --xla_cpu_collective_call_terminate_timeout_seconds=280"
)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import diffiface as di
from diffiface.test import check_gradients

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives between processes
jax.config.update("jax_cpu_enable_async_dispatch", False)  # see single_process.py


def loss(p, xb):
    return jnp.sum(jnp.tanh(xb @ p["w"] + p["b"]) ** 2)


def main() -> int:
    process, port = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process, initialization_timeout=60)
    failures = []
    assert jax.device_count() == 8 and jax.local_device_count() == 4, (jax.device_count(), jax.local_device_count())
    auto = (jax.sharding.AxisType.Auto,) * 2  # (the compiler lays out the contraction over "data")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)  # "data" spans the two processes
    w = np.arange(64.0, dtype=np.float32).reshape(16, 4) / 64
    b = np.linspace(-1, 1, 4, dtype=np.float32)
    xb = np.linspace(0, 1, 8 * 16, dtype=np.float32).reshape(8, 16)

    def put(a, *spec):  # each process makes only the shards its devices hold
        sharding = NamedSharding(mesh, PartitionSpec(*spec))
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    params = {"w": put(w, "data", "model"), "b": put(b, "model")}
    batch = put(xb, None, "data")
    local = sum(s.data.size for leaf in params.values() for s in leaf.addressable_shards)
    if params["w"].is_fully_addressable or local >= w.size + b.size:
        failures.append(f"the model is not split between the processes ({local} numbers here)")

    expected = jax.grad(loss)({"w": jnp.asarray(w), "b": jnp.asarray(b)}, jnp.asarray(xb))  # one process's answer
    with jax.transfer_guard("disallow"):
        grad = di.gradient(loss, di.AutoJAX(), params, di.Constant(batch))
    for key in params:
        if not grad[key].sharding.is_equivalent_to(params[key].sharding, params[key].ndim):
            failures.append(f"gradient[{key}] sharding {grad[key].sharding}")
        for shard in grad[key].addressable_shards:
            want = np.asarray(expected[key])[shard.index]
            if not np.allclose(np.asarray(shard.data), want, rtol=1e-5, atol=1e-6):
                failures.append(f"gradient[{key}] shard {shard.index} differs from one process's")
    try:
        with jax.transfer_guard("disallow"):
            report = check_gradients(loss, params, di.Constant(batch), projections=2)
        if not all(row.status == "passed" for row in report.rows):
            failures.append(report.table())
    except Exception as exc:
        failures.append(f"check_gradients raised {type(exc).__name__}: {str(exc)[:400]}")
    for line in failures:
        print("FAILED", f"process {process}:", line)
    print(f"process {process}: {len(failures)} failed", flush=True)
    jax.distributed.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
