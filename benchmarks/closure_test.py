"""The staleness test of an unprepared call: the test a closure settles once for a function
(``Closure.holds``, diffiface/_prep.py's ``_settled_holds``) against the general one that reads f
again on every call (``Closure._holds``). Each unprepared call of a compiled engine runs one of
them before it reuses its prep.

    taskset -c 1 python benchmarks/closure_test.py

One process, interleaved rounds. The functions are what a loss looks like: a global array, a
module-level helper it calls, a default and a keyword-only default. Writes
benchmarks/results/closure_test.json and .md: per case, each test's time per call and the
settled one's ratio to the general one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import write_results

from diffiface import _prep
from diffiface.test._benchmark import time_pair

RESULTS = Path(__file__).resolve().parent / "results"

TABLE = np.arange(64.0)
SCALE = 0.5


def _helper(v: Any) -> Any:
    return v * SCALE


def loss(v: Any, power: int = 2, *, k: float = 1.0) -> Any:
    """A global array, a global number, a default and a keyword-only default."""
    return (k * SCALE * TABLE * v**power).sum()


def namespace_of(v: Any) -> Any:
    module = type(v).__module__
    if module.startswith("jax"):
        import jax.numpy as jnp

        return jnp
    return np


def tiny(v: Any) -> Any:
    """benchmarks/run.py's 10-input function: a helper that picks the array namespace, no array."""
    m = namespace_of(v)
    return m.sum(m.tanh(v) * v)


def with_helper(v: Any) -> Any:
    """A module-level helper it calls: each function followed gets its own settled test."""
    return (_helper(v) * TABLE).sum()


def _closure_case() -> Any:
    weights = np.linspace(0.0, 1.0, 64)

    def closed(v: Any) -> Any:
        return (weights * v).sum()

    return closed


def rows(rounds: int) -> list[dict[str, Any]]:
    out = []
    cases = (
        ("a helper picking the namespace, no array", tiny),
        ("globals and defaults", loss),
        ("a helper", with_helper),
        ("a closure", _closure_case()),
    )
    for label, f in cases:
        closure = _prep.Closure(f)
        assert closure.holds(f) and closure._holds(f)
        settled, _, general, ratio = time_pair(
            lambda c=closure, g=f: c.holds(g), lambda c=closure, g=f: c._holds(g), rounds, 20_000
        )
        out.append({"case": label, "settled_s": settled, "general_s": general, "ratio": ratio})
        print(f"{label}: settled {settled * 1e6:.2f} us, general {general * 1e6:.2f} us, ratio {ratio:.2f}", flush=True)
    return out


def main() -> None:
    found = rows(rounds=15)
    write_results(
        "closure_test",
        "taskset -c 1 python benchmarks/closure_test.py",
        "The staleness test of an unprepared call",
        "`ratio` = the settled test (`Closure.holds`) / the general one (`Closure._holds`), the median "
        "over 15 interleaved rounds of the ratio within a round.",
        ["case", "settled_s", "general_s", "ratio"],
        found,
        lambda r: [r["case"], f"{r['settled_s']:.3g}", f"{r['general_s']:.3g}", f"{r['ratio']:.2f}"],
    )


if __name__ == "__main__":
    main()
