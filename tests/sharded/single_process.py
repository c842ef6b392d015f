"""Sharded jax checks in one process with 4 simulated CPU devices (a 2 x 2 mesh).

Run by tests/test_sharded_jax.py in a subprocess (XLA_FLAGS must be set before jax is
imported); exits non-zero naming the check that failed."""

from __future__ import annotations

import os
import sys

# (on a loaded machine of few cores a simulated device's thread may come late to a collective:
# XLA's CPU rendezvous would abort the process after 40 s; it waits longer than one run's bound
# in tests/test_sharded_jax.py, which ends a hung run and starts another. Now and then an eager
# op's all-reduce on the simulated devices never gets all of its threads, a hang. Over 8 devices
# (a 2 x 4 mesh, an all-reduce of 4 threads) it hung in 2 runs of 38 on 2 cores, and twice in a
# row in a CI run beside another test worker; 4 devices (2 x 2) ask 2 threads of each collective)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    " --xla_force_host_platform_device_count=4"
    " --xla_cpu_multi_thread_eigen=false"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
    " --xla_cpu_collective_call_terminate_timeout_seconds=280"
)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

import diffiface as di
from diffiface import tree
from diffiface.test import check_gradients

# Simulated CPU devices on few cores: one program at a time, so that two programs' collectives
# never wait on each other for the same threads (XLA's CPU rendezvous gives up after 40 s).
jax.config.update("jax_cpu_enable_async_dispatch", False)

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        failures.append(f"{name}: {detail}")


def loss(p, xb):
    return jnp.sum(jnp.tanh(xb @ p["w"] + p["b"]) ** 2)


def out(p, xb):
    return jnp.tanh(xb @ p["w"] + p["b"])


def same_layout(a, b) -> bool:
    return a.sharding.is_equivalent_to(b.sharding, a.ndim)


def run_mesh(axis_type: AxisType) -> None:
    tag = axis_type.name
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type, axis_type))

    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec)))

    w = np.arange(32.0, dtype=np.float32).reshape(8, 4) / 32
    b = np.linspace(-1, 1, 4, dtype=np.float32)
    xb = np.linspace(0, 1, 128, dtype=np.float32).reshape(16, 8)
    params = {"w": put(w, "data", "model"), "b": put(b, "model")}
    batch = put(xb, "data", None)
    plain = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    plain_batch = jnp.asarray(xb)
    ty = out(params, batch)
    be = di.AutoJAX()
    calls = {
        "gradient": (di.gradient, loss, (params,)),
        "value_and_gradient": (di.value_and_gradient, loss, (params,)),
        "jvp": (di.jvp, out, (params, params)),
        "vjp": (di.vjp, out, (params, ty)),
        "hvp": (di.hvp, loss, (params, params)),
        "jacobian": (di.jacobian, out, (params,)),
        "hessian": (di.hessian, loss, (params,)),
    }
    expected = {
        "gradient": jax.grad(loss)(plain, plain_batch),
        "value_and_gradient": jax.value_and_grad(loss)(plain, plain_batch),
        "jvp": jax.jvp(lambda p: out(p, plain_batch), (plain,), (plain,))[1],
        "vjp": jax.vjp(lambda p: out(p, plain_batch), plain)[1](out(plain, plain_batch))[0],
        "hvp": jax.jvp(jax.grad(lambda p: loss(p, plain_batch)), (plain,), (plain,))[1],
        "jacobian": jax.jacrev(out)(plain, plain_batch),
        "hessian": jax.hessian(loss)(plain, plain_batch),
    }
    for name, (op, f, head) in calls.items():
        prepare = getattr(di, f"prepare_{name}")
        for prepared in (False, True):
            label = f"{tag} {name}{' prepared' if prepared else ''}"
            try:
                kwargs = {"prep": prepare(f, be, *head, di.Constant(batch))} if prepared else {}
                with jax.transfer_guard("disallow"):
                    result = op(f, be, *head, di.Constant(batch), **kwargs)
            except Exception as exc:
                check(label, False, f"raised {type(exc).__name__}: {str(exc)[:300]}")
                continue
            got = jax.tree.leaves(result)
            want = jax.tree.leaves(expected[name])
            for g, e in zip(got, want, strict=True):
                check(label, np.allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6), "values differ")
            if name in ("gradient", "vjp", "hvp"):
                for key in params:
                    check(label, same_layout(result[key], params[key]), f"{key}: {result[key].sharding.spec}")
            if name == "jvp":
                check(label, same_layout(result, ty), f"{result.sharding}")
            if name in ("jacobian", "hessian"):  # blocks: x_j's layout on the trailing dims
                rows = result if name == "jacobian" else [result[k] for k in params]
                for row in [rows] if name == "jacobian" else rows:
                    for key in params:
                        spec = tuple(row[key].sharding.spec)
                        lead = row[key].ndim - params[key].ndim
                        trail = spec[lead:] + (None,) * (row[key].ndim - len(spec))
                        want_spec = tuple(params[key].sharding.spec) + (None,) * params[key].ndim
                        check(label, all(s is None for s in spec[:lead]), f"{key}: leading dims {spec}")
                        check(label, trail[: params[key].ndim] == want_spec[: params[key].ndim], f"{key}: {spec}")

    # a prep is made for one layout: another layout of the same shapes is refused, by name
    prep = di.prepare_gradient(loss, be, params, di.Constant(batch))
    other = {"w": put(w, None, "model"), "b": params["b"]}
    try:
        di.gradient(loss, be, other, di.Constant(batch), prep=prep)
        check(f"{tag} prep layout", False, "a prep made for another layout was used")
    except di.PreparationMismatchError as exc:
        check(f"{tag} prep layout", "laid out as" in str(exc), str(exc)[:300])
    with jax.transfer_guard("disallow"):
        moved = di.gradient(loss, be, other, di.Constant(batch))  # unprepared: a prep of its own
    check(f"{tag} other layout", same_layout(moved["w"], other["w"]), str(moved["w"].sharding))

    # derivative of a scalar t: y keeps the batch's sharding
    s = put(np.float32(0.5))
    with jax.transfer_guard("disallow"):
        d = di.derivative(lambda t, x: jnp.sin(t * x), be, s, di.Constant(batch))
    check(f"{tag} derivative", same_layout(d, batch), str(d.sharding))

    # finite differences: jvp on the devices; the gradient too on a mesh with automatic axes
    fd = di.AutoFiniteDifferences()
    with jax.transfer_guard("disallow"):
        tj = di.jvp(out, fd, params, params, di.Constant(batch))
    check(f"{tag} fd jvp layout", same_layout(tj, ty), str(tj.sharding))
    check(f"{tag} fd jvp values", np.allclose(np.asarray(tj), np.asarray(expected["jvp"]), rtol=2e-2, atol=2e-3))
    # a non-finite tangent entry: J[:, i] * t_i, as forward mode (through numpy), never all NaN
    t_inf = put(np.where(np.arange(8) == 2, np.inf, 0.0).astype(np.float32), None)
    ti = di.jvp(lambda v: v * v, fd, put(np.linspace(0, 1, 8, dtype=np.float32), None), t_inf)
    check(f"{tag} fd jvp non-finite", np.isinf(np.asarray(ti)[2]) and not np.isnan(np.asarray(ti)[3]), str(ti))
    # the operators that finite differences build in numpy are refused on sharded x, never gathered
    for name in ("jacobian", "hessian"):
        try:
            getattr(di, name)(loss if name == "hessian" else out, fd, params, di.Constant(batch))
            check(f"{tag} fd {name} refused", False, "a sharded x was gathered on the host")
        except di.UnsupportedOperationError as exc:
            check(f"{tag} fd {name} refused", "sharded over several devices" in str(exc), str(exc)[:200])
    try:
        with jax.transfer_guard("disallow"):
            g = di.gradient(loss, fd, params, di.Constant(batch))
        for key in params:
            check(f"{tag} fd gradient layout", same_layout(g[key], params[key]), str(g[key].sharding))
            close = np.allclose(np.asarray(g[key]), np.asarray(expected["gradient"][key]), rtol=2e-2, atol=2e-3)
            check(f"{tag} fd gradient values", close)
    except Exception as exc:
        check(f"{tag} fd gradient", False, f"raised {type(exc).__name__}: {str(exc)[:300]}")

    # tree.ravel: the flat vector made on the devices, unravel gives back each sharding
    wider = {"w": params["w"], "b": put(np.linspace(-1, 1, 8, dtype=np.float32), "model")}  # 40 numbers
    try:
        with jax.transfer_guard("disallow"):
            flat, unravel = tree.ravel(wider)
            back = unravel(flat)
        check(f"{tag} ravel layout", flat.sharding.spec == PartitionSpec(("data", "model")), str(flat.sharding))
        for key in wider:
            check(f"{tag} unravel layout", same_layout(back[key], wider[key]), str(back[key].sharding))
            check(f"{tag} unravel values", np.array_equal(np.asarray(back[key]), np.asarray(wider[key])))
        order = np.concatenate([np.asarray(leaf).reshape(-1) for leaf in tree.leaves(wider)])
        check(f"{tag} ravel values", np.array_equal(np.asarray(flat), order))
    except Exception as exc:
        check(f"{tag} ravel", False, f"raised {type(exc).__name__}: {str(exc)[:300]}")

    # check_gradients: directions and ground truth on the devices, scalars back
    try:
        with jax.transfer_guard("disallow"):
            report = check_gradients(loss, params, di.Constant(batch), projections=2)
        check(f"{tag} check_gradients", all(row.status == "passed" for row in report.rows), report.table())
    except Exception as exc:
        check(f"{tag} check_gradients", False, f"raised {type(exc).__name__}: {str(exc)[:300]}")

    # a wrong gradient is caught on the devices too
    def wrong(p, xb):
        return loss(p, xb) + jax.lax.stop_gradient(jnp.sum(p["b"]))

    try:
        with jax.transfer_guard("disallow"):
            check_gradients(wrong, params, di.Constant(batch), projections=1)
        check(f"{tag} check_gradients catches", False, "a wrong gradient passed")
    except AssertionError:
        pass


def run_device_three() -> None:
    dev = jax.devices()[3]
    x = jax.device_put(jnp.linspace(0.1, 1.0, 6, dtype=jnp.float32), dev)
    t = jax.device_put(jnp.ones(6, jnp.float32), dev)
    for backend in (di.AutoJAX(), di.AutoJAX(jit=False), di.AutoFiniteDifferences(), di.AutoScipy()):
        for name, call in (
            ("gradient", lambda backend=backend: di.gradient(lambda v: jnp.sum(jnp.sin(v)), backend, x)),
            ("jvp", lambda backend=backend: di.jvp(jnp.sin, backend, x, t)),
            ("vjp", lambda backend=backend: di.vjp(jnp.sin, backend, x, t)),
            ("jacobian", lambda backend=backend: di.jacobian(jnp.sin, backend, x)),
        ):
            label = f"device 3 {backend.name} {name}"
            try:
                result = call()
            except Exception as exc:
                check(label, False, f"raised {type(exc).__name__}: {str(exc)[:200]}")
                continue
            check(label, result.sharding.device_set == {dev}, str(result.sharding))
            reference = {"gradient": np.cos, "jvp": np.cos, "vjp": np.cos}.get(name)
            if reference is not None:
                check(label, np.allclose(np.asarray(result), np.cos(np.asarray(x)), rtol=1e-3, atol=1e-4), "values")
    # a large input the tangent does not move leaves the step along the other small
    with jax.enable_x64(True):
        x = jax.device_put(jnp.array([1e8, 0.5]), dev)
        t = jax.device_put(jnp.array([0.0, 1.0]), dev)
    mixed = di.jvp(lambda v: jnp.sin(v[1]), di.AutoFiniteDifferences(), x, t)
    check("device 3 fd jvp mixed scales", abs(float(mixed) - np.cos(0.5)) < 1e-8, str(mixed))
    # single-device sharding stays a single-device sharding on device 3
    check("device 3 kind", isinstance(x.sharding, SingleDeviceSharding), str(x.sharding))


def main() -> int:
    assert len(jax.devices()) == 4, jax.devices()
    run_mesh(AxisType.Explicit)
    run_mesh(AxisType.Auto)  # the same shapes on the same devices: other layouts, other programs
    run_device_three()
    for line in failures:
        print("FAILED", line)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
