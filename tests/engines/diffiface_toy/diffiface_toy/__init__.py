"""A toy engine for diffiface from outside its tree: forward mode by dual numbers, in pure Python.

It registers itself through the ``diffiface.engines`` entry point (see pyproject.toml), with a
config class, an adapter module and a registry row, and nothing else: the test that installs it
shows that a new engine needs no edit to diffiface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffiface import Backend
from diffiface._adapters import BackendInfo

__all__ = ["ENGINE", "AutoToy"]


@dataclass(frozen=True)
class AutoToy(Backend):
    """Differentiate with dual numbers, one forward pass per tangent."""

    name: ClassVar[str] = "toy"


ENGINE = BackendInfo(
    name="toy",
    config=AutoToy,
    module="diffiface_toy.adapter",
    requires=(),
    extra=None,
    forward_mode=True,
    reverse_mode=False,
    native=frozenset({"pushforward"}),
    arrays="numpy",
)
