"""The torch adapter's fused calls (``_Gradient``, ``_Pullback``, ``_Pushforward``, ``_Hvp``;
where none is kept, both contenders take the guard's steps) against the plain guard path they shortcut: the same prepared call, one prep made
with the fused call and one without it, timed in interleaved rounds in one process. A fused call
is kept only where it is more than 5% quicker. Run it pinned::

    taskset -c 1 python benchmarks/torch_fused.py

Prints, per operator, mode and size, both times and plain / fused, and writes them to
benchmarks/results/torch_fused.json and .md. ``python benchmarks/torch_fused.py jvp`` times the
cases whose name holds ``jvp`` alone (and writes nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved, write_results

import diffiface as di
import diffiface._adapters.torch._fused as adapter
from diffiface._prep import prep_cache


def cases() -> dict[str, tuple[Any, ...]]:
    """name -> (operator, f, x, tangent or None, contexts)."""
    torch.manual_seed(0)
    ten = {f"p{i}": torch.randn(8) for i in range(10)}
    mlp = {"w1": torch.randn(16, 32) * 0.1, "b1": torch.zeros(32), "w2": torch.randn(32, 4) * 0.1}
    data = torch.randn(64, 16)

    def ten_loss(p: Any) -> Any:
        return sum((torch.tanh(v) ** 2).sum() for v in p.values())

    def ten_map(p: Any) -> Any:
        return {k: torch.tanh(v) * v for k, v in p.items()}

    def mlp_loss(p: Any, d: Any) -> Any:
        return (torch.tanh(d @ p["w1"] + p["b1"]) @ p["w2"]).square().mean()

    def mlp_map(p: Any, d: Any) -> Any:
        return torch.tanh(d @ p["w1"] + p["b1"]) @ p["w2"]

    vec = torch.randn(32)

    def vec_map(v: Any) -> Any:
        return torch.tanh(v) * v.sum()

    t_ten = {k: torch.randn_like(v) for k, v in ten.items()}
    t_mlp = {k: torch.randn_like(v) for k, v in mlp.items()}
    ctx = (di.Constant(data),)
    return {
        "gradient, 10 inputs": ("gradient", ten_loss, ten, None, ()),
        "gradient, MLP": ("gradient", mlp_loss, mlp, None, ctx),
        "vjp, 10 inputs": ("vjp", ten_map, ten, {k: torch.randn(8) for k in ten}, ()),
        "vjp, MLP": ("vjp", mlp_map, mlp, torch.randn(64, 4), ctx),
        "jvp, 10 inputs": ("jvp", ten_map, ten, t_ten, ()),
        "jvp, MLP": ("jvp", mlp_map, mlp, t_mlp, ctx),
        "hvp, 10 inputs": ("hvp", ten_loss, ten, t_ten, ()),
        "hvp, MLP": ("hvp", mlp_loss, mlp, t_mlp, ctx),
        "jacobian, 32": ("jacobian", vec_map, vec, None, ()),
    }


ROUNDS = 21


def main(only: str = "") -> None:
    torch.set_num_threads(1)
    fused_table = dict(adapter._FUSED)
    computations = {  # (the operator's computation, as _FUSED names it)
        "gradient": "value_and_gradient",
        "vjp": "value_and_pullback",
        "jvp": "value_and_pushforward",
        "hvp": "gradient_and_hvp",
        "jacobian": "jacobian",
    }
    rows = []
    for name, (op, f, x, t, contexts) in cases().items():
        if only not in name:
            continue
        for backend in (di.AutoTorch(), di.AutoTorch(mode="func")):
            args = (x, *(() if t is None else (t,)), *contexts)
            preps = {}
            for kind in ("fused", "plain"):
                prep_cache.clear()
                adapter._FUSED.clear()
                if kind == "fused":
                    adapter._FUSED.update(fused_table)
                preps[kind] = getattr(di, f"prepare_{op}")(f, backend, *args)
            adapter._FUSED.update(fused_table)
            call = getattr(di, op)
            times = interleaved(
                {
                    kind: (lambda p=p, call=call, f=f, backend=backend, args=args: call(f, backend, *args, prep=p))
                    for kind, p in preps.items()
                },
                rounds=ROUNDS,
                repeat=20,
                warmups=3,
            )
            print(
                f"{name:22s} {backend.mode:8s} fused {times['fused'] * 1e6:8.1f} us  plain "
                f"{times['plain'] * 1e6:8.1f} us  plain/fused {times['plain'] / times['fused']:.3f}",
                flush=True,
            )
            kept = (computations[op], backend.mode == "func") in fused_table
            rows.append(
                {
                    "case": name,
                    "mode": backend.mode,
                    "fused_s": times["fused"],
                    "plain_s": times["plain"],
                    "plain_over_fused": times["plain"] / times["fused"],
                    "fused_call": kept,
                }
            )
    if only:
        return
    write_results(
        "torch_fused",
        "taskset -c 1 python benchmarks/torch_fused.py",
        "torch's fused calls against the guard's steps",
        f"torch {torch.__version__}, one thread; the median of {ROUNDS} interleaved rounds. `plain / fused` over "
        "1.05 keeps a fused call (docs/design.md); where `fused call` is no, both contenders take the guard's "
        "steps, and the ratio shows the noise.",
        ["case", "mode", "fused (us)", "plain (us)", "plain / fused", "fused call"],
        rows,
        lambda r: [
            r["case"],
            r["mode"],
            f"{r['fused_s'] * 1e6:.1f}",
            f"{r['plain_s'] * 1e6:.1f}",
            f"{r['plain_over_fused']:.3f}",
            "yes" if r["fused_call"] else "no",
        ],
        torch=torch.__version__,
        rounds=ROUNDS,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
