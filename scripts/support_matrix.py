"""Render the generated parts of the documentation from the library itself.

- the backends' support matrix, from the registry rows ``diffiface._adapters.BACKENDS``;
- the table of error classes, from ``diffiface._errors.__all__``.

The docs build calls these through ``scripts/docs_hooks.py``; run this file to print both::

    python scripts/support_matrix.py
"""

from __future__ import annotations

import inspect

# Display order of the operators an adapter may implement natively; names the registry uses
# that are missing here are appended, so a new capability shows up without editing this file.
_OPERATOR_ORDER = (
    "pushforward",
    "pullback",
    "gradient",
    "jacobian",
    "derivative",
    "hvp",
    "hessian",
    "second_derivative",
)
# The public operator each adapter primitive serves.
_PUBLIC_NAME = {"pushforward": "jvp", "pullback": "vjp"}


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _operator_names(rows: tuple[object, ...]) -> list[str]:
    declared: set[str] = set()
    for row in rows:
        declared |= set(row.native)  # type: ignore[attr-defined]
    return (
        [name for name in _OPERATOR_ORDER if name in declared]
        + sorted(declared - set(_OPERATOR_ORDER))
        + [name for name in _OPERATOR_ORDER if name not in declared]
    )


def _code_list(names: list[str]) -> str:
    return ", ".join(f"`{_PUBLIC_NAME.get(n, n)}`" for n in names) if names else "—"


def support_matrix() -> str:
    """The support matrix as a Markdown table, one row per registry row."""
    from diffiface._adapters import BACKENDS

    operators = _operator_names(BACKENDS)
    lines = [
        "| backend | string name | install | forward mode | reverse mode | native | derived by diffiface | jit | any array type |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in BACKENDS:
        native = [op for op in operators if op in row.native]
        derived = [op for op in operators if op not in row.native]
        install = f'`pip install "diffiface[{row.extra}]"`' if row.extra else "built in"
        lines.append(
            f'| `{row.config.__name__}()` | `"{row.name}"` | {install} | {_yes_no(row.forward_mode)} | '
            f"{_yes_no(row.reverse_mode)} | {_code_list(native)} | {_code_list(derived)} | "
            f"{_yes_no(row.jit)} | {_yes_no(row.any_array_type)} |"
        )
    return "\n".join(lines) + "\n"


def error_table() -> str:
    """Every exception class of ``diffiface._errors.__all__``: its standard bases and its docstring."""
    from diffiface import _errors

    lines = ["| class | also an instance of | what it means |", "|---|---|---|"]
    for name in _errors.__all__:
        cls = getattr(_errors, name)
        bases = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins"]
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        summary = summary.replace(":class:", "").replace("~diffiface.", "").replace("``", "`").replace("|", "\\|")
        also = ", ".join(f"`{b}`" for b in bases) or "—"
        lines.append(f"| [`{name}`](#{name.lower()}) | {also} | {summary} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(support_matrix())
    print(error_table())
