"""The registry: the one table that knows which backends exist.

Each row names a backend's config class, the module of its adapter (imported on first use),
the modules its engine needs, the extra that installs them, and its capabilities. The
capabilities drive dispatch, the project's test skips and the docs' support matrix.

Engines that diffiface does not ship join the table through an entry point of the group
``diffiface.engines`` (docs/backends.md): its name is the backend's name, and it names a
:class:`BackendInfo` whose ``config`` and ``module`` are the package's own. Entry points are
read on the first lookup of a name that is not built in, of a config class the table does not
know, or when the backends are listed; never at ``import diffiface``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import threading
from typing import TYPE_CHECKING, Any

from .._backends import (
    AutoAutograd,
    AutoFiniteDifferences,
    AutoJAX,
    AutoMLX,
    AutoPyTensor,
    AutoScipy,
    AutoSparse,
    AutoTensorFlow,
    AutoTorch,
    Backend,
    SecondOrder,
)
from .._errors import BackendUnavailableError, DiffifaceError, UnknownBackendError
from ._row import BackendInfo

if TYPE_CHECKING:
    from ._base import Adapter

__all__ = [
    "BACKENDS",
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "adapter_for",
    "available",
    "info",
    "labels",
    "names_of",
    "normalize",
    "rows",
]


def _shipped(name: str, config: type[Backend], **columns: Any) -> BackendInfo:
    """The row of an engine diffiface ships: its adapter is ``diffiface._adapters.<name>``, and
    unless ``columns`` say otherwise it has both modes and needs the package of its name, which
    the extra of that name installs."""
    both_modes = {"forward_mode": True, "reverse_mode": True}
    columns = {"module": f"diffiface._adapters.{name}", "requires": (name,), "extra": name, **both_modes, **columns}
    return BackendInfo(name=name, config=config, **columns)


_FIRST = frozenset({"pushforward", "pullback", "gradient"})
_EVERY = _FIRST | {"jacobian", "hessian", "hvp", "derivative", "second_derivative"}
BACKENDS: tuple[BackendInfo, ...] = (
    _shipped("jax", AutoJAX, native=_FIRST | {"jacobian"}, arrays="jax", complex_convention="conjugate", jit=True),
    _shipped(
        "torch",
        AutoTorch,
        native=_EVERY - {"derivative"},
        arrays="torch",
        complex_convention="direct",
        reverse_first=True,
    ),
    # autograd's pushforward: two reverse passes
    _shipped(
        "autograd", AutoAutograd, forward_mode=False, native=_FIRST, complex_convention="conjugate", reverse_first=True
    ),
    _shipped(
        "tensorflow",
        AutoTensorFlow,
        native=_FIRST,
        arrays="tensorflow",
        complex_convention="direct",
        jit=True,
        reverse_first=True,
    ),
    # pytensor's pushforward: two pullbacks (pytensor's own default), so reverse products cost less
    _shipped("pytensor", AutoPyTensor, native=_EVERY, jit=True, reverse_first=True),
    _shipped(
        "mlx",
        AutoMLX,
        native=_FIRST | {"jacobian", "hvp", "hessian"},
        arrays="mlx",
        complex_convention="direct",
        complex_second_order=(
            "mlx's second derivatives through complex operations can be wrong with no error (in mlx "
            "0.32 the derivative of abs's vjp on a complex array is zero)"
        ),
        jit=True,
        float64_precision="float32",
    ),
    _shipped(
        "finite_differences",
        AutoFiniteDifferences,
        requires=(),
        extra=None,
        reverse_mode=False,
        native=_EVERY,
        arrays="any",
    ),
    _shipped("scipy", AutoScipy, forward_mode=False, reverse_mode=False, native=_EVERY, arrays="any"),
)

_BY_NAME = {row.name: row for row in BACKENDS}
_BY_CONFIG: dict[type[Backend], BackendInfo] = {row.config: row for row in BACKENDS}
#: Names of a backend with an option set: the labels that ``python -m diffiface.test`` and its
#: reports use, accepted wherever a backend name is.
_ALIASES: dict[str, Backend] = {
    "torch-func": AutoTorch(mode="func"),
    "torch-autograd": AutoTorch(mode="autograd"),
    "torch-compile": AutoTorch(mode="func", compile=True),
}
_BUILT_IN_NAMES = frozenset({*_BY_NAME, *_ALIASES})


def normalize(backend: Backend | str) -> Backend:
    """A backend object from a backend object or its string name."""
    if isinstance(backend, Backend):
        if (
            not isinstance(backend, (SecondOrder, AutoSparse))
            and type(backend) not in _BY_CONFIG
            and type(backend) not in {row.config for row in rows()}  # (entry points loaded)
        ):
            raise UnknownBackendError(f"{backend!r} is not a backend diffiface knows.")
        return backend
    if isinstance(backend, str):
        alias = _ALIASES.get(backend)
        if alias is not None:
            return alias
        row = _BY_NAME.get(backend)
        if row is None and backend in _entry_points():
            row = _row_of(_entry_points()[backend])
        if row is None:
            raise UnknownBackendError(
                f"Unknown backend name {backend!r}; the names are "
                f"{', '.join(map(repr, [*_BY_NAME, *_ALIASES, *_entry_points()]))}, or pass a backend "
                "object such as di.AutoJAX()."
            )
        return row.config()
    raise UnknownBackendError(
        f"backend must be a backend object (di.AutoJAX(), di.AutoTorch(), ...) or its name, "
        f"got {type(backend).__name__}: {backend!r}."
    )


class PublicSecondOrder(SecondOrder):
    """``di.SecondOrder``: the config, whose outer and inner backends may be given by name
    ("torch", "torch-func"), as every backend may."""

    __doc__ = SecondOrder.__doc__

    def __post_init__(self) -> None:
        for role in ("outer", "inner"):
            value = getattr(self, role)
            if isinstance(value, str):
                object.__setattr__(self, role, normalize(value))
        super().__post_init__()


PublicSecondOrder.__name__ = PublicSecondOrder.__qualname__ = "SecondOrder"


def rows() -> tuple[BackendInfo, ...]:
    """Every row of the registry: the built-in engines, then those of installed packages (their
    entry points loaded)."""
    return (*BACKENDS, *map(_row_of, _entry_points().values()))


def labels() -> dict[str, Backend]:
    """Every engine of the registry by its name, and each option set that has a name of its own
    (``"torch-func"``): the backends the main job and the reports know, in the registry's order."""
    found: dict[str, Backend] = {}
    for row in rows():
        found[row.name] = row.config()
        for name, alias in _ALIASES.items():
            if type(alias) is row.config and alias != found[row.name]:
                found[name] = alias
    return found


def names_of(backend: Backend) -> frozenset[str]:
    """The string names that mean ``backend`` (``"jax"`` for ``AutoJAX()``): a call may pass either."""
    names = {name for name, alias in _ALIASES.items() if alias == backend}
    row = _BY_CONFIG.get(type(backend))
    if row is not None and backend == row.config():
        names.add(row.name)
    return frozenset(names)


# -- engines of other packages: the ``diffiface.engines`` entry points ------------------------------

ENTRY_POINT_GROUP = "diffiface.engines"
_found: dict[str, Any] | None = None  # name -> entry point, read once


def _entry_points() -> dict[str, Any]:
    """The entry points of the group by name, read (not loaded) on first need."""
    global _found
    if _found is None:
        from importlib.metadata import entry_points

        with _lock:
            if _found is None:
                _found = {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}
    return _found


def _row_of(point: Any) -> BackendInfo:
    """The row an entry point names, loaded and checked once."""
    row = _loaded.get(point.name)
    if row is None:
        with _lock:
            row = _loaded.get(point.name)
            if row is None:
                row = _load(point)
                _BY_NAME[row.name] = _BY_CONFIG[row.config] = _loaded[row.name] = row
    return row


_loaded: dict[str, BackendInfo] = {}


def _load(point: Any) -> BackendInfo:
    dist = getattr(point, "dist", None)
    package = f"the package {dist.name!r}" if dist is not None else "an installed package"
    where = f"{package} (entry point {point.name!r} = {point.value!r} in the group {ENTRY_POINT_GROUP!r})"

    def refuse(problem: str) -> DiffifaceError:
        return DiffifaceError(f"The diffiface engine of {where} {problem} Fix or uninstall that package.")

    if point.name in _BUILT_IN_NAMES:
        raise refuse(
            f"takes the name {point.name!r}, which is a built-in backend's; an engine of another package "
            "needs a name of its own."
        )
    try:
        row = point.load()
    except Exception as exc:
        raise refuse(f"could not be loaded ({type(exc).__name__}: {exc}).") from exc
    if not isinstance(row, BackendInfo):
        raise refuse(f"names a {type(row).__name__}; it must name a diffiface BackendInfo (its registry row).")
    if row.name != point.name:
        raise refuse(f"names a row called {row.name!r}; the entry point's name and the row's must be one.")
    config = row.config
    if (
        not isinstance(config, type)
        or not issubclass(config, Backend)
        or not dataclasses.is_dataclass(config)
        or not config.__dataclass_params__.frozen  # type: ignore[attr-defined]
    ):
        raise refuse(f"gives the config {config!r}; it must be a frozen dataclass deriving from diffiface.Backend.")
    if config in _BY_CONFIG or issubclass(config, (SecondOrder, AutoSparse)):
        raise refuse(f"gives the config {config.__name__}, which is already another backend's.")
    if config.name != row.name:
        raise refuse(f"gives the config {config.__name__} whose name is {config.name!r}, not {row.name!r}.")
    if not isinstance(row.module, str) or not row.module:
        raise refuse(f"gives the adapter module {row.module!r}; it must be a module path such as 'mypackage.adapter'.")
    try:
        config()
    except Exception as exc:
        raise refuse(f"gives the config {config.__name__}, which cannot be made with no arguments ({exc}).") from exc
    return row


def info(backend: Backend | str) -> BackendInfo:
    """The registry row of a (first-order) backend; an AutoSparse's is its engine's."""
    backend = normalize(backend)
    if isinstance(backend, AutoSparse):
        return info(backend.backend)
    if isinstance(backend, SecondOrder):
        return info(backend.inner)
    return _BY_CONFIG[type(backend)]


def available(backend: Backend | str) -> bool:
    """Whether the engine of ``backend`` is installed (checked without importing it)."""
    backend = normalize(backend)
    if isinstance(backend, AutoSparse):  # patterns and colorings are scipy.sparse matrices
        return available(backend.backend) and importlib.util.find_spec("scipy") is not None
    if isinstance(backend, SecondOrder):
        return available(backend.outer) and available(backend.inner)
    return all(importlib.util.find_spec(name) is not None for name in info(backend).requires)


def install_hint(backend: Backend | str) -> str:
    row = info(backend)
    return f'pip install "diffiface[{row.extra}]"' if row.extra else "pip install diffiface"


_adapters: dict[Backend, Adapter] = {}
_lock = threading.RLock()  # reentrant: a SecondOrder adapter makes its outer and inner ones inside


def adapter_for(backend: Backend) -> Adapter:
    """The adapter of ``backend``, made once and cached; imports the engine on first use."""
    found = _adapters.get(backend)
    if found is not None:
        return found
    with _lock:
        found = _adapters.get(backend)
        if found is None:
            found = _make(backend)
            _adapters[backend] = found
    return found


def _make(backend: Backend) -> Adapter:
    if isinstance(backend, AutoSparse):  # its products are its engine's
        return adapter_for(backend.backend)
    if isinstance(backend, SecondOrder):
        from ._base import SecondOrderAdapter

        return SecondOrderAdapter(backend, adapter_for(backend.outer), adapter_for(backend.inner), adapter_for)
    row = info(backend)
    try:
        for name in row.requires:
            importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"The {row.name} backend needs {', '.join(row.requires)}, which is not installed "
            f"(importing it failed: {exc}). Install it with: {install_hint(backend)}"
        ) from exc
    try:
        module: Any = importlib.import_module(row.module)
    except ImportError as exc:
        if row.name in _BUILT_IN_NAMES:
            raise
        raise BackendUnavailableError(
            f"The {row.name} engine's adapter module {row.module!r} could not be imported ({exc}); "
            f"reinstall the package that registers the {row.name!r} engine."
        ) from exc
    return module.Adapter(backend, row)  # type: ignore[no-any-return]
