"""What torch users pass: diffiface's prepared gradient, the backend by its string name, against the
call a torch user writes on the same loss, with no copy.

    python benchmarks/run.py --torch-users [--quick] [--cpus 0]
    python benchmarks/torch_users.py [--quick] [--cpus 0]

One process, one torch thread, optionally pinned to ``--cpus``; each row times diffiface and the
native call in interleaved rounds (the median over rounds of the ratio within a round). The loss
is the recipe of docs/frameworks/torch-nn.md: ``torch.func.functional_call(model, params,
(inputs,))`` on a dict of the model's parameters, a mean squared error. The rows:

- ``a``: ``dict(model.named_parameters())`` (nn.Parameter) of a 64-128-16 MLP, batch 64, the
  model closed over; ``a-f64`` the same in float64;
- ``b``: the same with a 4 MB batch (16,384 x 64 float32);
- ``c``: the same parameters detached, 4 MB batch;
- ``d``: the parameters as x and the model as ``di.Constant(model)``, batch 1,024;
- ``e``: a trainable head (``named_parameters()`` of a Linear) on a frozen 4.2M-parameter backbone
  passed as ``di.Constant(backbone)``, batch 64; ``e-recipe`` the same as the torch.nn page passes
  it: the trainable parameters of ``Sequential(backbone, head)`` as x, that model as a Constant.

Each in autograd mode (``"torch"`` against ``torch.autograd.grad(loss, parameters)``) and in
torch.func mode (``"torch-func"`` against ``torch.func.grad(loss)``); the native autograd call
differentiates the parameters themselves, or, for detached ones, ``detach().requires_grad_()``
views of them (no copy). Where ``AutoTorch`` has a ``create_graph`` option, row ``a`` is also
timed with ``AutoTorch(create_graph=True)`` against ``torch.autograd.grad(..., create_graph=True)``.

Autograd rows also time the floor: the native call on ``detach().requires_grad_()`` aliases of
every parameter, what f must get where x is independent of what f closes over.

Writes benchmarks/results/torch_users.json and .md; where torch_users_before.json exists beside
them (an earlier run, kept), the table shows its ratios too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffiface as di
from diffiface.test._benchmark import time_pair

RESULTS = Path(__file__).resolve().parent / "results"
BEFORE = RESULTS / "torch_users_before.json"

GOALS = {"a": 1.10, "b": 1.05, "d": 1.10, "e": 1.05, "e-recipe": 1.05}
"""diffiface / native, the most each row may take (issue 37); rows ``a-f64`` and ``c`` have none."""

BIG_BATCH = 16_384  # x 64 float32: 4 MB
BACKBONE_WIDTH = 1024  # 64 -> 1024, then four 1024 x 1024 layers: 4.26M parameters


def loss(params: dict[str, Any], model: Any, batch: tuple[Any, Any]) -> Any:
    """The docs' recipe: the model run on ``params`` by torch.func, a mean squared error."""
    import torch

    inputs, targets = batch
    predictions = torch.func.functional_call(model, params, (inputs,))
    return ((predictions - targets) ** 2).mean()


def _mlp(dtype: Any) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16)).to(dtype)


def _batch(rows: int, inputs: int, outputs: int, dtype: Any, seed: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, inputs, generator=generator, dtype=dtype),
        torch.randn(rows, outputs, generator=generator, dtype=dtype),
    )


@dataclasses.dataclass
class Case:
    """One thing a user passes: ``f(x, *contexts)`` with ``contexts`` given as Constants."""

    row: str
    what: str
    f: Callable[..., Any]
    x: dict[str, Any]
    contexts: tuple[Any, ...]


def cases() -> list[Case]:
    import torch

    out = []
    for row, dtype in (("a", torch.float32), ("a-f64", torch.float64)):
        model = _mlp(dtype)
        batch = _batch(64, 64, 16, dtype, seed=1)
        out.append(
            Case(
                row,
                f"`dict(model.named_parameters())`, 64-128-16 MLP, batch 64, {str(dtype).removeprefix('torch.')}",
                lambda params, batch, model=model: loss(params, model, batch),
                dict(model.named_parameters()),
                (batch,),
            )
        )
    model = _mlp(torch.float32)
    big = _batch(BIG_BATCH, 64, 16, torch.float32, seed=2)
    closed = lambda params, batch: loss(params, model, batch)  # noqa: E731
    out.append(Case("b", "the same, batch 16,384 x 64 (4 MB)", closed, dict(model.named_parameters()), (big,)))
    detached = {name: p.detach() for name, p in model.named_parameters()}
    out.append(Case("c", "the same parameters detached, 4 MB batch", closed, detached, (big,)))
    model_d = _mlp(torch.float32)
    out.append(
        Case(
            "d",
            "`dict(model.named_parameters())`, the model as `di.Constant(model)`, batch 1,024",
            loss,
            dict(model_d.named_parameters()),
            (model_d, _batch(1024, 64, 16, torch.float32, seed=3)),
        )
    )
    torch.manual_seed(4)
    layers: list[Any] = [torch.nn.Linear(64, BACKBONE_WIDTH), torch.nn.Tanh()]
    for _ in range(4):
        layers += [torch.nn.Linear(BACKBONE_WIDTH, BACKBONE_WIDTH), torch.nn.Tanh()]
    backbone = torch.nn.Sequential(*layers).requires_grad_(False)
    head = torch.nn.Linear(BACKBONE_WIDTH, 16)
    size = sum(p.numel() for p in backbone.parameters())
    head_batch = _batch(64, 64, 16, torch.float32, seed=5)

    def head_loss(params: dict[str, Any], backbone: Any, batch: tuple[Any, Any]) -> Any:
        inputs, targets = batch
        predictions = torch.func.functional_call(head, params, (backbone(inputs),))
        return ((predictions - targets) ** 2).mean()

    out.append(
        Case(
            "e",
            f"a trainable head on a frozen {size / 1e6:.2f}M-parameter backbone as `di.Constant(backbone)`, batch 64",
            head_loss,
            dict(head.named_parameters()),
            (backbone, head_batch),
        )
    )
    tuned = torch.nn.Sequential(backbone, head)
    out.append(
        Case(
            "e-recipe",
            "the same as the torch.nn page passes it: the trainable parameters of `Sequential(backbone, head)`, "
            "the whole model as `di.Constant(model)`",
            loss,
            {name: p for name, p in tuned.named_parameters() if p.requires_grad},
            (tuned, head_batch),
        )
    )
    return out


def native(case: Case, mode: str, create_graph: bool = False, aliases: bool = False) -> Callable[[], dict[str, Any]]:
    """The call a torch user writes: ``torch.autograd.grad`` on the parameters themselves (on
    ``detach().requires_grad_()`` views of detached ones), or ``torch.func.grad``. With
    ``aliases``, on such views of every parameter: the least an x independent of what f closes
    over costs (the floor column)."""
    import torch

    if mode == "func":
        grad = torch.func.grad(case.f)
        return lambda: grad(case.x, *case.contexts)
    names = list(case.x)
    needs_view = aliases or not all(p.requires_grad for p in case.x.values())

    def call() -> dict[str, Any]:
        params = {k: p.detach().requires_grad_(True) for k, p in case.x.items()} if needs_view else case.x
        value = case.f(params, *case.contexts)
        grads = torch.autograd.grad(value, list(params.values()), create_graph=create_graph)
        return dict(zip(names, grads, strict=True))

    return call


def same_gradient(ours: Any, theirs: dict[str, Any]) -> bool:
    """Whether diffiface's result holds the native values: the same keys, and per key the same
    shape and dtype and values equal within torch's default tolerance for the dtype."""
    import torch

    if not isinstance(ours, dict) or ours.keys() != theirs.keys():
        return False
    for key, value in theirs.items():
        got = ours[key]
        if not isinstance(got, torch.Tensor) or got.shape != value.shape or got.dtype != value.dtype:
            return False
        try:
            torch.testing.assert_close(got.detach(), value.detach())
        except AssertionError:
            return False
    return True


def _keeps_graph(result: dict[str, Any]) -> bool:
    return any(v.requires_grad or v.grad_fn is not None for v in result.values())


def _backends() -> list[tuple[str, Any, str, bool]]:
    """(label, backend, native mode, create_graph) of each timed way: the string names, and the
    ``create_graph`` option where AutoTorch has it."""
    ways: list[tuple[str, Any, str, bool]] = [("torch", "torch", "autograd", False)]
    ways.append(("torch-func", "torch-func", "func", False))
    if "create_graph" in {f.name for f in dataclasses.fields(di.AutoTorch)}:
        ways.append(("AutoTorch(create_graph=True)", di.AutoTorch(create_graph=True), "autograd", True))
    return ways


def rows(rounds: int, number: int | None = None) -> list[dict[str, Any]]:
    """Every row, timed in ``rounds`` interleaved rounds of ``number`` calls (None: enough
    calls for a round of about 20 ms)."""
    out = []
    for case in cases():
        for label, backend, mode, create_graph in _backends():
            if create_graph and case.row != "a":
                continue
            row: dict[str, Any] = {"row": case.row, "backend": label, "what": case.what, "goal": GOALS.get(case.row)}
            constants = tuple(di.Constant(c) for c in case.contexts)
            step = "diffiface"
            try:
                prep = di.prepare_gradient(case.f, backend, case.x, *constants)

                def ours(
                    case: Case = case, backend: Any = backend, constants: Any = constants, prep: Any = prep
                ) -> Any:
                    return di.gradient(case.f, backend, case.x, *constants, prep=prep)

                result = ours()
                row["graph"] = "yes" if _keeps_graph(result) else "no"
                step = "native"
                theirs = native(case, mode, create_graph)
                expected = theirs()
                row["native graph"] = "yes" if _keeps_graph(expected) else "no"
                row["check"] = "same" if same_gradient(result, expected) else "DIFFERENT"
                del result, expected
                step = "timing"
                us, _, them, ratio = time_pair(ours, theirs, rounds, number)
                row.update(diffiface_s=us, native_s=them, ratio=ratio)
                if mode == "autograd" and not create_graph:
                    row["floor"] = time_pair(native(case, mode, aliases=True), theirs, rounds, number)[3]
                goal = row["goal"]
                row["met"] = None if goal is None else ("yes" if ratio <= goal else f"no (+{ratio / goal - 1:.1%})")
            except Exception as error:  # recorded, so that one failure does not hide the rest
                message = str(error).splitlines()[0][:120] if str(error) else ""
                row["note"] = f"{step} call failed: {type(error).__name__}: {message}"
            print(f"torch users: {case.row} {label} {row.get('ratio', row.get('note'))}", flush=True)
            out.append(row)
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _table(found: list[dict[str, Any]], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in found]
    return "\n".join(lines)


def write(found: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torch_users.json").write_text(json.dumps({"meta": meta, "rows": found}, indent=1))
    keys = [
        "row",
        "backend",
        "what",
        "native_s",
        "diffiface_s",
        "ratio",
        "floor",
        "goal",
        "met",
        "check",
        "graph",
        "native graph",
    ]
    if BEFORE.is_file():
        earlier = json.loads(BEFORE.read_text())
        by = {(r["row"], r["backend"]): r.get("ratio") for r in earlier["rows"]}
        for r in found:
            r["before"] = by.get((r["row"], r["backend"]))
        keys.insert(keys.index("goal"), "before")
        since = f" `before`: the ratio of the run of {earlier['meta']['date']} (torch_users_before.json)."
    else:
        since = ""
    failed = [r for r in found if r.get("note")]
    md = [
        "# What torch users pass",
        "",
        f"Generated by `python benchmarks/run.py --torch-users{' --quick' if meta['quick'] else ''}"
        f"{' --cpus ' + meta['cpus_option'] if meta['cpus_option'] else ''}` on {meta['date']} at commit "
        f"{meta.get('commit') or '(unknown)'} "
        f"(torch {meta['torch']}, {meta['machine']}, one torch thread, on CPUs {meta['cpus']} of "
        f"{meta['cpu_count']}, load average {meta['load_average_before']} before and "
        f"{meta['load_average_after']} after). `ratio` = diffiface / native, the median over "
        f"{meta['rounds']} interleaved rounds of the ratio within a round.",
        "",
        "diffiface: the prepared `di.gradient(loss, name, params, *constants, prep=prep)`, the backend by its "
        "string name. Native: `torch.autograd.grad(loss, parameters)` on the parameters themselves "
        "(`detach().requires_grad_(True)` views of detached ones; no copy) for `torch`, `torch.func.grad(loss)` "
        "for `torch-func`. The loss runs the model through `torch.func.functional_call` on the parameters' dict. "
        "`check`: diffiface's gradient holds the native values. `graph`: diffiface's result keeps an autograd "
        "graph (`requires_grad` or a `grad_fn`); `native graph`: the native call's does (torch.func.grad's results "
        "of tensors that require grad are part of the outer graph, by torch.func's design). `floor` (autograd "
        "rows): the native call on `detach().requires_grad_(True)` aliases of every parameter, over the native "
        "call, timed in rounds of its own: diffiface's x is independent of what f closes over (a regulariser "
        "on the same Parameter read through the model is a constant to it, as to torch.func and finite "
        "differences), so f gets such aliases, and no route can cost less than this." + since,
        "",
        _table([r for r in found if not r.get("note")], keys),
        "",
        *(["## Not timed", "", _table(failed, ["row", "backend", "what", "note"]), ""] if failed else []),
    ]
    text = "\n".join(md)
    (RESULTS / "torch_users.md").write_text(text)
    return text


def _commit() -> str | None:
    """The checkout's commit, so that a later run can be read against this one."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS)
    except OSError:
        return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 21")
    parser.add_argument("--cpus", help="run on these CPUs only, as in --cpus 0 or --cpus 0,1")
    args = parser.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    torch.set_num_threads(1)
    meta: dict[str, Any] = {
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": _commit(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "cpus_option": args.cpus,
        "threads": torch.get_num_threads(),
        "rounds": 5 if args.quick else 21,
        "load_average_before": [round(v, 2) for v in os.getloadavg()],
    }
    start = time.perf_counter()
    found = rows(meta["rounds"])
    meta["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    print(write(found, meta))


if __name__ == "__main__":
    main()
