"""The layer zoo and its torch twins, checked engine by engine without diffiface's core.

Every zoo loss must give the same value and gradient under numpy (central finite differences),
torch, jax and autograd, keep float32 as float32, and leave its inputs alone.
"""

from __future__ import annotations

import copy
import functools
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from diffiface.test._layers import LayerCase, layer_cases, namespace
from diffiface.test._torch_modules import TorchModuleCase, torch_module_cases

CASES = layer_cases()
CASES_BY_NAME = {case.name: case for case in CASES}
CASES_FLOAT32 = {case.name: case for case in layer_cases(np.float32)}
by_name = pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])

# The key bias of attention adds the same amount to every score of a row, which softmax
# cancels: its gradient is exactly zero, not a bug.
STRUCTURALLY_ZERO = {
    "attention": ("in_proj_bias", slice(4, 8)),
    "multihead_attention": ("in_proj_bias", slice(4, 8)),
}


# --------------------------------------------------------------------------------------------
# Trees: nested dicts, always traversed in sorted key order (as jax returns them)


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {key: tree_map(function, value) for key, value in tree.items()}
    return function(tree)


def leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in leaves(tree[key])]
    if isinstance(tree, tuple):
        return [leaf for subtree in tree for leaf in leaves(subtree)]
    if tree is None:
        return []
    return [tree]


def ravel(tree: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    arrays = [np.asarray(leaf) for leaf in leaves(tree)]
    flat = np.concatenate([array.ravel() for array in arrays])

    def unravel(vector: np.ndarray) -> Any:
        pieces = iter(np.split(vector, np.cumsum([array.size for array in arrays])[:-1]))

        def rebuild(subtree: Any) -> Any:
            if isinstance(subtree, dict):
                return {key: rebuild(subtree[key]) for key in sorted(subtree)}
            array = np.asarray(subtree)
            return next(pieces).reshape(array.shape).astype(array.dtype)

        return rebuild(tree)

    return flat, unravel


def flat_numpy(tree: Any) -> np.ndarray:
    return np.concatenate([np.asarray(to_numpy(leaf)).ravel() for leaf in leaves(tree)])


def to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def assert_trees_equal(actual: Any, expected: Any) -> None:
    assert len(leaves(actual)) == len(leaves(expected))
    for a, e in zip(leaves(actual), leaves(expected), strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(e))


def scalar(case: LayerCase, params: Any, data: Any = None, state: Any = None) -> Any:
    """The case's loss without its auxiliary output."""
    data = case.data if data is None else data
    state = case.state if state is None else state
    out = case.loss(params, case.config, data, state)
    return out[0] if case.has_aux else out


# --------------------------------------------------------------------------------------------
# Engines: gradient of a case at its params, flattened in sorted-key order


def torch_tensors(tree: Any, requires_grad: bool = False) -> Any:
    torch = pytest.importorskip("torch")
    return tree_map(lambda leaf: torch.tensor(np.asarray(leaf), requires_grad=requires_grad), tree)


def torch_value_and_gradient(case: LayerCase, convert_data: bool = False) -> tuple[Any, np.ndarray]:
    torch = pytest.importorskip("torch")
    params = torch_tensors(case.params, requires_grad=True)
    data = torch_tensors(case.data) if convert_data else case.data
    state = torch_tensors(case.state) if convert_data else case.state
    value = scalar(case, params, data, state)
    gradients = torch.autograd.grad(value, leaves(params))
    return value, np.concatenate([g.numpy().ravel() for g in gradients])


def case_named(name: str, dtype: str = "float64") -> LayerCase:
    return CASES_FLOAT32[name] if dtype == "float32" else CASES_BY_NAME[name]


@functools.cache
def jax_value_and_gradient_function(name: str, dtype: str, data_as_arguments: bool) -> Any:
    """``jit(value_and_grad(loss))``, built once per case: jit compiles the whole loss in one
    go, far faster than eager jax compiling every primitive of every case separately."""
    jax = pytest.importorskip("jax")
    case = case_named(name, dtype)
    if data_as_arguments:
        return jax.jit(jax.value_and_grad(lambda p, d, s: scalar(case, p, d, s)))
    # Data closed over stay numpy arrays inside the trace: the layers must convert them.
    return jax.jit(jax.value_and_grad(lambda p: scalar(case, p)))


def jax_value_and_gradient(case: LayerCase, convert_data: bool = False) -> tuple[Any, np.ndarray]:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    dtype = leaves(case.params)[0].dtype.name
    function = jax_value_and_gradient_function(case.name, dtype, convert_data)
    params = tree_map(jnp.asarray, case.params)
    if convert_data:
        data = tree_map(jnp.asarray, case.data)
        state = tree_map(jnp.asarray, case.state)
        value, gradient = function(params, data, state)
    else:
        value, gradient = function(params)
    return value, flat_numpy(gradient)


def autograd_value_and_gradient(case: LayerCase) -> tuple[Any, np.ndarray]:
    autograd = pytest.importorskip("autograd")
    value, gradient = autograd.value_and_grad(lambda p: scalar(case, p))(case.params)
    return value, flat_numpy(gradient)


def finite_difference_gradient(case: LayerCase) -> np.ndarray:
    x, unravel = ravel(case.params)
    gradient = np.empty_like(x)
    for i in range(x.size):
        step = 1e-6 * max(1.0, abs(x[i]))
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        gradient[i] = (scalar(case, unravel(up)) - scalar(case, unravel(down))) / (up[i] - down[i])
    return gradient


# --------------------------------------------------------------------------------------------
# 1. One value on every engine


@by_name
def test_value_is_the_same_on_every_engine(case: LayerCase) -> None:
    jax = pytest.importorskip("jax")
    expected = float(scalar(case, case.params))
    values = {
        "torch": torch_value_and_gradient(case)[0],
        "torch, torch data": torch_value_and_gradient(case, convert_data=True)[0],
        "autograd": autograd_value_and_gradient(case)[0],
    }
    with jax.enable_x64(True):
        values["jax"] = jax_value_and_gradient(case)[0]
    for engine, value in values.items():
        assert to_numpy(value).shape == (), engine
        np.testing.assert_allclose(float(to_numpy(value)), expected, rtol=1e-10, err_msg=engine)


# Everything above runs jax under jit, where params are tracers; a few cases also run eagerly on
# concrete jax arrays (eager jax compiles each primitive separately, so not all of them).
EAGER_JAX = ("conv_stride2", "lstm", "multihead_attention")


@pytest.mark.parametrize("name", EAGER_JAX)
def test_value_on_concrete_jax_arrays(name: str) -> None:
    jax = pytest.importorskip("jax")
    case = case_named(name)
    with jax.enable_x64(True):
        value = scalar(case, tree_map(jax.numpy.asarray, case.params))
    assert isinstance(value, jax.Array)
    np.testing.assert_allclose(float(value), float(scalar(case, case.params)), rtol=1e-10)


# --------------------------------------------------------------------------------------------
# 2. One gradient on every engine, and finite differences agree


@by_name
def test_gradient_is_the_same_on_every_engine(case: LayerCase) -> None:
    jax = pytest.importorskip("jax")
    torch_gradient = torch_value_and_gradient(case)[1]
    with jax.enable_x64(True):
        gradients = {
            "jax": jax_value_and_gradient(case)[1],
        }
    gradients["torch, torch data"] = torch_value_and_gradient(case, convert_data=True)[1]
    gradients["autograd"] = autograd_value_and_gradient(case)[1]
    scale = max(1.0, float(np.max(np.abs(torch_gradient))))
    for engine, gradient in gradients.items():
        np.testing.assert_allclose(
            gradient, torch_gradient, rtol=1e-9, atol=1e-12 * scale, err_msg=f"{engine} vs torch"
        )
    finite_differences = finite_difference_gradient(case)
    np.testing.assert_allclose(
        finite_differences, torch_gradient, rtol=1e-5, atol=1e-6 * scale, err_msg="finite differences"
    )


@by_name
def test_every_parameter_reaches_the_loss(case: LayerCase) -> None:
    gradient = torch_value_and_gradient(case)[1]
    mask = np.ones(gradient.shape, dtype=bool)
    if case.name in STRUCTURALLY_ZERO:
        leaf, entries = STRUCTURALLY_ZERO[case.name]
        zero = ravel(tree_map(np.zeros_like, case.params))[1](np.zeros_like(gradient))
        zero[leaf][entries] = 1
        mask = ravel(zero)[0] == 0
        np.testing.assert_allclose(gradient[~mask], 0, atol=1e-12)
    assert np.all(np.abs(gradient[mask]) > 1e-8 * np.max(np.abs(gradient))), case.name


# --------------------------------------------------------------------------------------------
# 3. float32 stays float32


@by_name
def test_float32_params_give_a_float32_loss(case: LayerCase) -> None:
    jax = pytest.importorskip("jax")
    case32 = CASES_FLOAT32[case.name]
    assert to_numpy(scalar(case32, case32.params)).dtype == np.float32, "numpy"
    torch_value, torch_gradient = torch_value_and_gradient(case32)
    assert to_numpy(torch_value).dtype == np.float32, "torch"
    autograd_value, autograd_gradient = autograd_value_and_gradient(case32)
    assert np.asarray(autograd_value).dtype == np.float32, "autograd"
    with jax.enable_x64(False):
        # Compiling is most of this suite's time, so jax sees numpy data (closed over) in float64
        # and jax data (as jit arguments, so tracers) in float32, each path once.
        jax_value, jax_gradient = jax_value_and_gradient(case32, convert_data=True)
    assert to_numpy(jax_value).dtype == np.float32, "jax"
    # Finite differences are too noisy in float32, normalisation most of all: compare the
    # engines with each other and with the float64 gradient instead.
    reference = torch_value_and_gradient(case)[1]
    scale = max(1.0, float(np.max(np.abs(reference))))
    for engine, gradient in {"torch": torch_gradient, "jax": jax_gradient, "autograd": autograd_gradient}.items():
        assert gradient.dtype == np.float32, engine
        np.testing.assert_allclose(gradient, reference, rtol=1e-3, atol=1e-4 * scale, err_msg=engine)


# --------------------------------------------------------------------------------------------
# 4. Inputs are never mutated


@by_name
def test_inputs_are_not_mutated(case: LayerCase) -> None:
    jax = pytest.importorskip("jax")
    inputs = (case.params, case.data, case.state)
    before = copy.deepcopy(inputs)
    scalar(case, case.params)
    autograd_value_and_gradient(case)
    with jax.enable_x64(True):
        jax_value_and_gradient(case)
    assert_trees_equal(inputs, before)

    torch_inputs = tuple(torch_tensors(tree) for tree in inputs)
    torch_before = copy.deepcopy(torch_inputs)
    params = tree_map(lambda leaf: leaf.requires_grad_(), torch_inputs[0])
    scalar(case, params, torch_inputs[1], torch_inputs[2]).backward()
    assert_trees_equal(tuple(tree_map(lambda t: t.detach(), tree) for tree in torch_inputs), torch_before)


def test_batch_norm_train_returns_new_state_and_keeps_the_old() -> None:
    (case,) = [case for case in CASES if case.name == "batch_norm_train"]
    assert case.has_aux
    assert case.state is not None
    state_before = copy.deepcopy(case.state)
    _loss, new_state = case.loss(case.params, case.config, case.data, case.state)
    assert_trees_equal(case.state, state_before)
    assert set(new_state) == set(case.state)
    for key in case.state:
        assert new_state[key].shape == case.state[key].shape
        assert not np.allclose(new_state[key], case.state[key]), key


# --------------------------------------------------------------------------------------------
# Randomness and namespaces


def test_dropout_is_deterministic_given_its_key() -> None:
    (case,) = [case for case in CASES if case.name == "dropout"]
    first = scalar(case, case.params)
    assert scalar(case, case.params) == first
    other_key = {**case.config, "key": case.config["key"] + 1}
    assert case.loss(case.params, other_key, case.data, None) != first


def test_namespace_ignores_python_scalars_and_recognises_autograd() -> None:
    autograd = pytest.importorskip("autograd")
    assert namespace(np.ones(2), 1.0, 2).__name__ == "array_api_compat.numpy"
    seen: list[Any] = []

    def probe(x: Any) -> Any:
        xp = namespace(x, 3.0)
        seen.append(xp)
        return xp.sum(x * x)

    autograd.grad(probe)(np.ones(3))
    assert "autograd" in seen[0].__name__
    with pytest.raises(TypeError, match="only Python scalars"):
        namespace(1.0)


def test_namespace_refuses_to_mix_frameworks() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError):
        namespace(torch.ones(2), np.ones(2))


def test_importing_the_zoo_imports_no_framework() -> None:
    # The package's own __init__ belongs to the core; load these two modules on their own.
    package = pathlib.Path(__file__).resolve().parents[1] / "diffiface"
    code = (
        "import sys, types\n"
        "package = types.ModuleType('diffiface')\n"
        f"package.__path__ = [{str(package)!r}]\n"
        "sys.modules['diffiface'] = package\n"
        "import diffiface.test._layers, diffiface.test._torch_modules\n"
        "diffiface.test._layers.layer_cases()\n"
        "print(sorted(m for m in ('torch', 'jax', 'autograd') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# 5. torch.nn twins


def _torch_cases() -> list[TorchModuleCase]:
    """Fresh cases: a train-mode module's buffers are as the zoo's state says."""
    pytest.importorskip("torch")
    return torch_module_cases()


@functools.cache
def _shared_torch_cases() -> dict[str, TorchModuleCase]:
    """Cases built once, for tests that do not depend on the modules' buffers."""
    return {case.name: case for case in _torch_cases()}


_TWINNED = {
    "dense", "dense_nobias", "dense_tanh", "dense_chain", "conv", "conv_pad1", "conv_stride2",
    "conv_chain", "conv_meanpool", "conv_maxpool", "bilinear", "conv_transpose", "rnn", "lstm",
    "gru", "lstm_dense", "group_norm", "layer_norm", "instance_norm", "batch_norm_train",
    "batch_norm_eval", "attention", "multihead_attention", "embedding",
}  # fmt: skip
by_torch_name = pytest.mark.parametrize("name", sorted(_TWINNED))


def _torch_case(name: str, fresh: bool = False) -> TorchModuleCase:
    if fresh:
        (case,) = [case for case in _torch_cases() if case.name == name]
        return case
    return _shared_torch_cases()[name]


_TORCH_ONLY = {"batch_norm_train_aux": "stateful", "dropout_generator": "random"}
"""torch cases without a twin in the layer zoo, and the tag that says why they run in train mode:
the new running statistics returned through has_aux; dropout drawn from an explicit generator."""


def test_torch_cases_are_the_twinned_ones() -> None:
    cases = _torch_cases()
    assert {case.name for case in cases} == _TWINNED | set(_TORCH_ONLY)
    for case in cases:
        names = {name for name, _ in case.module.named_parameters()}
        assert set(case.params) == names, case.name
        training = "mutates_state" in case.tags or _TORCH_ONLY.get(case.name) in case.tags
        assert case.module.training == training, case.name


@by_torch_name
def test_torch_func_grad_agrees_with_torch_autograd(name: str) -> None:
    torch = pytest.importorskip("torch")
    case = _torch_case(name)
    module = case.module
    params = {key: torch.tensor(value, requires_grad=True) for key, value in case.params.items()}
    expected = torch.autograd.grad(case.loss(params, module, case.data), list(params.values()))
    point = {key: torch.tensor(value) for key, value in case.params.items()}
    if "mutates_state" in case.tags:
        # torch.func refuses to differentiate a function that mutates a captured buffer ...
        with pytest.raises(RuntimeError, match="in-place"):
            torch.func.grad(lambda p: case.loss(p, module, case.data))(point)

        # ... and accepts it once the buffers are created inside the function.
        def loss(p: Any) -> Any:
            buffers = {key: buffer.clone() for key, buffer in module.named_buffers()}
            return case.loss({**p, **buffers}, module, case.data)
    else:

        def loss(p: Any) -> Any:
            return case.loss(p, module, case.data)

    gradient = torch.func.grad(loss)(point)
    for key, value in zip(params, expected, strict=True):
        np.testing.assert_allclose(gradient[key].numpy(), value.numpy(), rtol=1e-10, atol=1e-14, err_msg=key)


def test_train_mode_batch_norm_module_mutates_its_buffers() -> None:
    torch = pytest.importorskip("torch")
    cases = {case.name: case for case in _torch_cases()}
    for name, mutates in (("batch_norm_train", True), ("batch_norm_eval", False)):
        case = cases[name]
        before = {key: buffer.clone() for key, buffer in case.module.named_buffers()}
        params = {key: torch.tensor(value) for key, value in case.params.items()}
        case.loss(params, case.module, case.data)
        changed = {key for key, buffer in case.module.named_buffers() if not torch.equal(buffer, before[key])}
        assert changed == (set(before) if mutates else set()), name
    assert "mutates_state" in cases["batch_norm_train"].tags


@by_torch_name
def test_torch_twin_agrees_with_the_zoo(name: str) -> None:
    torch = pytest.importorskip("torch")
    case = _torch_case(name, fresh=True)
    (zoo,) = [zoo for zoo in CASES if zoo.name == case.twin]
    params = {key: torch.tensor(value, requires_grad=True) for key, value in case.params.items()}
    value = case.loss(params, case.module, {key: torch.as_tensor(v) for key, v in case.data.items()})
    np.testing.assert_allclose(value.item(), float(scalar(zoo, zoo.params)), rtol=1e-10)
    gradient = torch.autograd.grad(value, list(params.values()))
    module_gradient = {key: g.numpy() for key, g in zip(params, gradient, strict=True)}
    zoo_gradient = torch_value_and_gradient(zoo)[1]
    # The module's names are the zoo's joined by dots (a lone dense layer gains 'dense.').
    prefix = "dense." if set(case.params) != {".".join(p) for p in _paths(zoo.params)} else ""
    ordered = [module_gradient[prefix + ".".join(path)] for path in _paths(zoo.params)]
    np.testing.assert_allclose(np.concatenate([g.ravel() for g in ordered]), zoo_gradient, rtol=1e-9, atol=1e-12)
    if zoo.has_aux:
        _, new_state = zoo.loss(zoo.params, zoo.config, zoo.data, zoo.state)
        for key in ("running_mean", "running_var"):
            buffer = getattr(case.module.norm, key)
            np.testing.assert_allclose(buffer.numpy(), new_state[key], rtol=1e-10, err_msg=key)


def _paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(tree, dict):
        return [path for key in sorted(tree) for path in _paths(tree[key], (*prefix, key))]
    return [prefix]
