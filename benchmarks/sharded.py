"""check_gradients and the first-order operators on a 10M-parameter model sharded over 8
simulated CPU devices (a 2 x 4 mesh): time, and peak memory per device in units of the
model's shard on a device.

    python benchmarks/sharded.py

Writes benchmarks/results/sharded.json and sharded.md. Memory is measured by a thread that
samples ``jax.live_arrays()`` every millisecond and adds up, per device, the bytes of the
shard each array holds there (``sharding.shard_shape``): the arrays a call keeps alive between
programs. jax's CPU backend gives no device memory statistics (``memory_stats()`` is None),
so the scratch buffers inside one compiled program are not counted.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json
import platform
import threading
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import diffiface as di
from diffiface.test import check_gradients

jax.config.update("jax_cpu_enable_async_dispatch", False)  # see docs/large-models.md

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH, OUT, BATCH = 2048, 800, 32


class PeakMemory:
    """The most bytes of live jax arrays on any one device while the block runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            per_device: dict[object, int] = defaultdict(int)
            for array in jax.live_arrays():
                try:  # (from the sharding: reading addressable_shards would make arrays of its own)
                    for device in array.sharding.device_set:
                        per_device[device] += _shard_bytes(array, device)
                except Exception:  # an array deleted while it was being read
                    continue
            self.peak = max(self.peak, max(per_device.values(), default=0))
            self._stop.wait(0.001)

    def __enter__(self) -> PeakMemory:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _shard_bytes(array, device) -> int:
    """The bytes of ``array``'s shard on ``device``, from its sharding (``addressable_shards``
    would keep an array per shard alive, counted twice by the sampler)."""
    if device not in array.sharding.device_set:
        return 0
    return int(np.prod(array.sharding.shard_shape(array.shape))) * array.dtype.itemsize


def loss(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"])
    return jnp.mean((h @ p["w3"] + p["b3"]) ** 2)


def main() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    rng = np.random.default_rng(0)

    def put(shape, *spec):
        a = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        return jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec)))

    params = {
        "w1": put((WIDTH, WIDTH), "data", "model"),
        "b1": put((WIDTH,), "model"),
        "w2": put((WIDTH, WIDTH), "data", "model"),
        "b2": put((WIDTH,), "model"),
        "w3": put((WIDTH, OUT), "data", "model"),
        "b3": put((OUT,), "model"),
    }
    batch = put((BATCH, WIDTH), "data", None)
    size = sum(leaf.size for leaf in params.values())
    device = jax.devices()[0]
    shard = sum(_shard_bytes(leaf, device) for leaf in params.values())
    batch_shard = _shard_bytes(batch, device)
    print(f"{size:,} parameters, {shard / 2**20:.2f} MiB per device (batch {batch_shard / 2**20:.2f} MiB)")
    be = di.AutoJAX()
    scalar = jax.device_put(np.float32(1.0), NamedSharding(mesh, PartitionSpec()))
    calls = {
        "gradient": lambda: di.gradient(loss, be, params, di.Constant(batch)),
        "value_and_gradient": lambda: di.value_and_gradient(loss, be, params, di.Constant(batch)),
        "jvp": lambda: di.jvp(loss, be, params, params, di.Constant(batch)),
        "vjp": lambda: di.vjp(loss, be, params, scalar, di.Constant(batch)),
        "hvp": lambda: di.hvp(loss, be, params, params, di.Constant(batch)),
        "check_gradients (8 directions)": lambda: check_gradients(loss, params, di.Constant(batch)),
    }
    rows = []
    for name, call in calls.items():
        start = time.perf_counter()
        with jax.transfer_guard("disallow"):
            jax.block_until_ready(call())  # first call: compiles
        first = time.perf_counter() - start
        base = PeakMemory()
        with base:
            time.sleep(0.01)
        with PeakMemory() as memory, jax.transfer_guard("disallow"):
            start = time.perf_counter()
            result = call()
            jax.block_until_ready(result)
            seconds = time.perf_counter() - start
        del result
        rows.append(
            {
                "operator": name,
                "first_call_s": round(first, 3),
                "seconds": round(seconds, 3),
                "peak_per_device_bytes": memory.peak,
                "before_in_shards": round(base.peak / shard, 2),
                "peak_in_shards": round(memory.peak / shard, 2),
                "extra_in_shards": round((memory.peak - base.peak) / shard, 2),
            }
        )
        print(rows[-1], flush=True)
    results = {
        "setup": {
            "parameters": size,
            "devices": 8,
            "mesh": "2 x 4 (data, model), automatic axes",
            "shard_bytes_per_device": shard,
            "batch_bytes_per_device": batch_shard,
            "dtype": "float32",
            "jax": jax.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "memory": "live jax arrays per device (sharding.shard_shape), sampled every 1 ms; "
            "scratch buffers inside one compiled program not counted",
        },
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sharded.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    lines = [
        f"# Sharded model: {size:,} float32 parameters over 8 simulated CPU devices (2 x 4 mesh)",
        "",
        f"One shard (the model's part on one device): {shard / 2**20:.2f} MiB; the batch's: "
        f"{batch_shard / 2**20:.2f} MiB. Peak: the most bytes of live jax arrays on one device during "
        "the call, the model and batch included; extra: above what was live before the call. "
        "Second call timed (the first compiles).",
        "",
        "| operator | first call (s) | time (s) | live before (shards) | peak per device (shards) | extra (shards) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['operator']} | {row['first_call_s']} | {row['seconds']} | {row['before_in_shards']} | "
            f"{row['peak_in_shards']} | "
            f"{row['extra_in_shards']} |"
        )
    lines += ["", f"jax {jax.__version__}, {platform.machine()}, {os.cpu_count()} CPUs (shared)."]
    (RESULTS / "sharded.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
