"""Dual numbers ``value + tangent * e`` with ``e**2 == 0``, nested by tags.

Each forward pass tags its duals with a new number, so that a pass inside another (a Hessian is
the pushforward of a gradient) keeps its own tangents apart from the outer pass's: an operation
on duals of two passes treats the one of the older pass as a constant of the newer.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Any

from diffiface import UnsupportedOperationError

_tags = itertools.count(1)


def new_tag() -> int:
    return next(_tags)


def _tag(value: Any) -> int:
    return value.tag if isinstance(value, Dual) else 0


def _parts(value: Any, tag: int) -> tuple[Any, Any]:
    """``value`` as ``(value, tangent)`` of the pass ``tag`` (a constant has tangent 0)."""
    if isinstance(value, Dual) and value.tag == tag:
        return value.value, value.tangent
    return (value if isinstance(value, Dual) else float(value)), 0.0


def _call(name: str, value: Any) -> Any:
    return getattr(value, name)() if isinstance(value, Dual) else getattr(math, name)(value)


class Dual:
    __slots__ = ("tag", "tangent", "value")

    def __init__(self, value: Any, tangent: Any, tag: int) -> None:
        self.value = value
        self.tangent = tangent
        self.tag = tag

    def __repr__(self) -> str:
        return f"Dual({self.value!r}, {self.tangent!r}, tag={self.tag})"

    @staticmethod
    def _operands(a: Any, b: Any) -> tuple[int, Any, Any, Any, Any] | None:
        if isinstance(b, numbers.Complex) and not isinstance(b, numbers.Real):
            raise UnsupportedOperationError("the toy engine's dual numbers are real; it cannot take complex numbers.")
        if not isinstance(b, (Dual, numbers.Real)):
            return None  # an array: numpy broadcasts and calls back element by element
        tag = max(_tag(a), _tag(b))
        return (tag, *_parts(a, tag), *_parts(b, tag))

    def __add__(self, other: Any) -> Any:
        found = self._operands(self, other)
        if found is None:
            return NotImplemented
        tag, u, du, v, dv = found
        return Dual(u + v, du + dv, tag)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        found = self._operands(self, other)
        if found is None:
            return NotImplemented
        tag, u, du, v, dv = found
        return Dual(u - v, du - dv, tag)

    def __rsub__(self, other: Any) -> Any:
        found = self._operands(other, self)
        if found is None:
            return NotImplemented
        tag, u, du, v, dv = found
        return Dual(u - v, du - dv, tag)

    def __mul__(self, other: Any) -> Any:
        found = self._operands(self, other)
        if found is None:
            return NotImplemented
        tag, u, du, v, dv = found
        return Dual(u * v, du * v + u * dv, tag)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Any:
        found = self._operands(self, other)
        if found is None:
            return NotImplemented
        tag, u, du, v, dv = found
        return Dual(u / v, (du * v - u * dv) / (v * v), tag)

    def __rtruediv__(self, other: Any) -> Any:
        found = self._operands(other, self)
        if found is None:
            return NotImplemented
        tag, u, du, v, dv = found
        return Dual(u / v, (du * v - u * dv) / (v * v), tag)

    def __neg__(self) -> Dual:
        return Dual(-self.value, -self.tangent, self.tag)

    def __pos__(self) -> Dual:
        return self

    def __pow__(self, other: Any) -> Any:
        if isinstance(other, numbers.Integral) or (isinstance(other, numbers.Real) and float(other).is_integer()):
            n = int(other)
            if n == 0:
                return Dual(self.value**0, 0.0, self.tag)
            return Dual(self.value**n, n * self.value ** (n - 1) * self.tangent, self.tag)
        found = self._operands(self, other)
        if found is None:
            return NotImplemented
        return (other * self.log()).exp()  # a real power of a positive base

    def __rpow__(self, other: Any) -> Any:
        if not isinstance(other, numbers.Real):
            return NotImplemented
        return (self * math.log(float(other))).exp()

    def sin(self) -> Dual:
        return Dual(_call("sin", self.value), _call("cos", self.value) * self.tangent, self.tag)

    def cos(self) -> Dual:
        return Dual(_call("cos", self.value), -_call("sin", self.value) * self.tangent, self.tag)

    def exp(self) -> Dual:
        value = _call("exp", self.value)
        return Dual(value, value * self.tangent, self.tag)

    def log(self) -> Dual:
        return Dual(_call("log", self.value), self.tangent / self.value, self.tag)
