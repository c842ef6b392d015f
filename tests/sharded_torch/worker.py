"""One rank of the 2-process gloo group of tests/test_sharded_torch.py: runs every case of
cases.py in order on a 1-D CPU mesh and writes each outcome to ``<out>/rank<r>.json``.

Usage: ``python worker.py RANK WORLD_SIZE PORT OUT`` (MASTER_ADDR 127.0.0.1)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import warnings


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    warnings.simplefilter("error")  # as pytest runs (pyproject's filterwarnings)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import CASES

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, run in CASES.items():
        start = time.perf_counter()
        try:
            run(mesh)
            results[name] = {"ok": True, "seconds": time.perf_counter() - start}
        except BaseException as exc:  # reported to the test, which fails
            results[name] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-4000:]}
        dist.barrier()  # a case that fails on one rank only must not shift the next case's collectives
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
