"""What kind of array a leaf is, and moving leaves between kinds, without importing frameworks.

Each framework's knowledge lives in its family module (:mod:`diffiface._families`); this module
finds a leaf's family once per class and dispatches to it, naming no framework itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import numpy as np

from ._families import BY_KIND as BY_KIND
from ._families import Family, foreign_tree, of_type
from ._families import Kind as Kind  # (named by the modules that type a kind)
from ._families import by_kind as by_kind
from ._families.numpy import in_native_byte_order as in_native_byte_order
from ._families.numpy import native_dtype as native_dtype

_KIND_BY_TYPE: dict[type, Kind] = {}
_SIGNATURE_BY_TYPE: dict[type, Any] = {}  # (each class's family ``signature``, found once)


def kind(leaf: Any) -> Kind:
    """The array kind of one leaf: its family's name, or ``"other"``."""
    cls = type(leaf)
    found = _KIND_BY_TYPE.get(cls)
    if found is not None:
        return found
    found = _classify(cls)
    if found != "other":
        _KIND_BY_TYPE[cls] = found
    return found


def kind_of_type(cls: type) -> Kind:
    """The array kind of the leaves of class ``cls``."""
    found = _KIND_BY_TYPE.get(cls)
    return found if found is not None else _classify(cls)


def _classify(cls: type) -> Kind:
    family = of_type(cls)
    return "other" if family is None else cast(Kind, family.NAME)


_KIND_BY_TYPE.update((cls, _classify(cls)) for cls in (float, int, bool, complex, np.ndarray))


_FAMILY_BY_TYPE: dict[type, Family] = {}
"""Each class's family, found once; read inline (``_FAMILY_BY_TYPE.get(cls) or _family(leaf)``)
where a leaf is converted, so that a known class costs no call."""


def family_of(leaf: Any) -> Family | None:
    """The family of ``leaf``, None for the kind ``"other"``."""
    return _FAMILY_BY_TYPE.get(type(leaf)) or _family(leaf)


def _family(leaf: Any) -> Family | None:
    family = BY_KIND.get(kind(leaf))
    if family is not None:
        _FAMILY_BY_TYPE[type(leaf)] = family
    return family


def numpy_like(leaf: Any) -> Any:
    """The numpy-like module of ``leaf``'s family (numpy for a leaf no family owns), already
    imported since the leaf exists."""
    family = _FAMILY_BY_TYPE.get(type(leaf)) or _family(leaf)
    return np if family is None else family.numpy_like()


def is_array(leaf: Any) -> bool:
    """True for the leaves of an array family (not Python numbers, not autograd's boxes)."""
    family = _FAMILY_BY_TYPE.get(type(leaf)) or _family(leaf)
    return family is not None and family.ARRAY


def resolution(leaf: Any) -> float:
    """The relative spacing of the values an array leaf holds: its dtype's machine epsilon, or
    that of the precision its family's float64 functions are accurate to (mlx's: float32); 0
    for a Python number or a leaf of no float or complex dtype, whose precision is not known."""
    name = dtype_name(leaf)
    if type(leaf) in (float, complex) or not name.startswith(("float", "complex", "bfloat")):
        return 0.0
    if name in ("float64", "complex128"):
        name = getattr(family_of(leaf), "FLOAT64_PRECISION", "float64")
    try:
        return float(np.finfo(np.dtype(name)).eps)
    except TypeError:  # (a dtype numpy lacks: bfloat16)
        return 2.0**-7 if name == "bfloat16" else 0.0


def dtype_name(leaf: Any) -> str:
    """The dtype of a leaf as a plain string ('float32', 'int64', ...)."""
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        return "int64"
    if isinstance(leaf, float):
        return "float64"
    if isinstance(leaf, complex):
        return "complex128"
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return type(leaf).__name__
    names = _DTYPE_NAMES.get(type(dtype))  # (str() of a dtype costs more than the rest of a quick call's checks)
    if names is None:
        names = _DTYPE_NAMES[type(dtype)] = {}
    try:
        return names[dtype]
    except (KeyError, TypeError):
        pass
    # (a non-native byte order, ">f8" as read from FITS or HDF5, is the same number type)
    name = str(native_dtype(dtype))
    name = name.rpartition(".")[2]  # a framework's own dtype prints as "module.float32"
    if name.startswith("<dtype"):  # (TensorFlow's prints as "<dtype: 'float32'>": it names itself)
        name = str(getattr(dtype, "name", name))
    with contextlib.suppress(TypeError):  # an unhashable dtype of some other library: not kept
        names[dtype] = name
    return name


_DTYPE_NAMES: dict[type, dict[Any, str]] = {}
"""Each dtype's name, by the dtype's class, then by the dtype: a compiled torch trace reads this
table, and would otherwise hash every framework's dtypes, some in C where torch.compile cannot
trace (mlx's)."""


def shape(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", ()))


FLOAT_WIDTHS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
"""The floating-point dtypes, each with its width in bits."""


def is_float_dtype(name: str) -> bool:
    return name in FLOAT_WIDTHS


def leaf_signature(leaf: Any) -> tuple[Any, ...]:
    """What a prep depends on for one leaf: its family's signature (kind, shape, dtype and
    whatever else results depend on: a tensor's device, a jax array's sharding)."""
    signature = _SIGNATURE_BY_TYPE.get(type(leaf))
    if signature is not None:
        return signature(leaf)  # type: ignore[no-any-return]
    family = _FAMILY_BY_TYPE.get(type(leaf)) or _family(leaf)
    if family is None:  # (not kept: a foreign class's structure is read from each leaf)
        return ("other", type(leaf), *foreign_tree(leaf))
    _SIGNATURE_BY_TYPE[type(leaf)] = family.signature
    return family.signature(leaf)


def to_numpy(leaf: Any) -> np.ndarray:
    """A numpy copy or view of a leaf of any kind (detached from any graph)."""
    family = _FAMILY_BY_TYPE.get(type(leaf)) or _family(leaf)
    return np.asarray(leaf) if family is None else family.to_numpy(leaf)


def from_numpy(array: np.ndarray, like: Any, dtype: Any = None) -> Any:
    """``array`` as a leaf of ``like``'s kind, on its device, with ``like``'s dtype unless given."""
    family = _FAMILY_BY_TYPE.get(type(like)) or _family(like)
    if family is None:
        return np.asarray(array, dtype=getattr(like, "dtype", None) if dtype is None else dtype)
    return family.from_numpy(array, like, dtype)


def family(kinds: set[Kind]) -> Kind:
    """The one array kind of a set of leaves; Python numbers go with any kind."""
    arrays = kinds - {"python"}
    if not arrays:
        return "python"
    if len(arrays) == 1:
        return next(iter(arrays))
    return "other"
