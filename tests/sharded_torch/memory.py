"""Peak extra memory of each operator on DTensors, in units of the model's size per rank.

Not a test (it takes a minute and a few GB): run by hand,

    python tests/sharded_torch/memory.py [MEGABYTES_PER_RANK [OPERATOR_SUBSTRING]]

It starts one 2-process gloo group per operator (fresh processes: ``ru_maxrss`` is a
high-water mark). Each rank builds its shard of w (float32, Shard(0)) in place with
DTensor.from_local, so nothing full-size is ever allocated; after a warm-up call on a small
tensor, the rise of the process's peak resident memory over one call on w, divided by the
shard's size, is the operator's peak extra memory. The native ``torch.autograd.grad`` is
measured the same way as the baseline.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys

OPERATORS = [
    "native torch.autograd.grad",
    "gradient AutoTorch()",
    "gradient AutoTorch(mode='func')",
    "value_and_gradient AutoTorch()",
    "vjp AutoTorch()",
    "hvp AutoTorch()",
    "jvp AutoFiniteDifferences()",
    "check_gradients(projections=1, backends=['torch'])",
]


def loss(w):  # type: ignore[no-untyped-def]
    import torch

    return (torch.sin(w) ** 2).sum()


def run(operator: str, w, t):  # type: ignore[no-untyped-def]
    import torch

    import diffiface as di
    from diffiface.test import check_gradients

    if operator.startswith("native"):
        leaf = w.detach().requires_grad_(True)
        return torch.autograd.grad(loss(leaf), leaf)[0]
    if operator.startswith("gradient"):
        return di.gradient(loss, di.AutoTorch(mode="func" if "func" in operator else "autograd"), w)
    if operator.startswith("value_and_gradient"):
        return di.value_and_gradient(loss, di.AutoTorch(), w)
    if operator.startswith("vjp"):
        return di.vjp(lambda w: torch.sin(w), di.AutoTorch(), w, t)
    if operator.startswith("hvp"):
        return di.hvp(loss, di.AutoTorch(), w, t)
    if operator.startswith("jvp"):
        return di.jvp(loss, di.AutoFiniteDifferences(), w, t)
    return check_gradients(loss, w, projections=1, backends=["torch"])


def rank_main(rank: int, port: str, operator: str, megabytes: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    rows = megabytes * 2**20 // (4 * 1024)

    def sharded(local_rows: int, seed: int):  # type: ignore[no-untyped-def]
        local = torch.randn(local_rows, 1024, generator=torch.Generator().manual_seed(seed + rank))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    run(operator, sharded(8, 0), sharded(8, 1))  # warm-up: lazy imports, torch's first-call work
    w, t = sharded(rows, 0), sharded(rows, 1)
    size = w.to_local().nbytes
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = run(operator, w, t)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del result
    dist.barrier()
    print(json.dumps({"rank": rank, "extra": (after - before) / size}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    chosen = sys.argv[2] if len(sys.argv) > 2 else ""
    for operator in (op for op in OPERATORS if chosen in op):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(rank), port, operator, str(megabytes)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            outs = [p.communicate(timeout=300)[0] for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
        extras = [json.loads(line)["extra"] for out in outs for line in out.splitlines() if line.startswith("{")]
        print(f"{operator:55s} peak extra memory: {max(extras):.2f} x the model (per rank)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
