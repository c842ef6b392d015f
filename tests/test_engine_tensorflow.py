"""The TensorFlow engine: the scenario suite, what TensorFlow users pass (variables, a Keras 3
model's trainable variables, tensor and numpy batches), the contract (nothing mutated, results
mirror x, float64 kept), complex numbers in the project's convention, refusals, and jit.

Skipped, with the reason, where TensorFlow is not installed (it has an environment of its own
in CI: the extra ``diffiface[tensorflow]``)."""

from __future__ import annotations

import os
import warnings
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # (TensorFlow's C++ start-up notes on stderr)

import numpy as np
import pytest

import diffiface as di
from diffiface.test import check_gradients, core_scenarios, test_differentiation

tf = pytest.importorskip(
    "tensorflow", reason='the tensorflow backend is not installed: pip install "diffiface[tensorflow]"'
)

BACKENDS = [pytest.param(di.AutoTensorFlow(), id="eager"), pytest.param(di.AutoTensorFlow(jit=True), id="jit")]


def loss(x: Any, scale: Any = 1.0) -> Any:
    return tf.reduce_sum(scale * tf.sin(x) * x**2)


def loss_grad(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return scale * (np.cos(x) * x**2 + 2 * x * np.sin(x))


# -- the scenario suite ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_core_scenarios(backend: di.Backend) -> None:
    scenarios = core_scenarios(quick=True)
    report = test_differentiation([backend], scenarios)
    assert report.counts().get("passed", 0) == len(scenarios), report.summary()


def test_string_name_is_the_default_backend() -> None:
    x = tf.constant([0.5, -1.0])
    expected = di.gradient(loss, di.AutoTensorFlow(), x)
    got = di.gradient(loss, "tensorflow", x)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


# -- what TensorFlow users pass --------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_variable_gives_a_tensor_of_its_dtype_and_is_not_written(backend: di.Backend, dtype: str) -> None:
    start = np.array([0.3, -1.2, 2.0], dtype=dtype)
    variable = tf.Variable(start)
    prep = di.prepare_value_and_gradient(loss, backend, variable)
    for _ in range(2):
        value, grad = di.value_and_gradient(loss, backend, variable, prep=prep)
        assert type(grad) is type(tf.constant(0.0)), type(grad)
        assert grad.dtype == variable.dtype and value.dtype == variable.dtype
        np.testing.assert_allclose(grad.numpy(), loss_grad(start.astype(np.float64)), rtol=1e-5)
    np.testing.assert_array_equal(variable.numpy(), start)
    # a new value of the same variable is read anew: no stale value from the prep
    variable.assign(start + 1.0)
    grad = di.gradient(loss, backend, variable)
    np.testing.assert_allclose(grad.numpy(), loss_grad((start + 1.0).astype(np.float64)), rtol=1e-5)


def _keras_model(dtype: str = "float32") -> Any:
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip(f"Keras runs on {keras.backend.backend()}, not TensorFlow")
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh", dtype=dtype), keras.layers.Dense(1, dtype=dtype)]
    )


def keras_loss(trainable: list[Any], model: Any, non_trainable: list[Any], data: Any, target: Any) -> Any:
    prediction, _ = model.stateless_call(trainable, non_trainable, data)
    return tf.reduce_mean((prediction - target) ** 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", ["tensor", "numpy"])
def test_keras_trainable_variables(backend: di.Backend, batch: str) -> None:
    model = _keras_model()
    rng = np.random.default_rng(0)
    data, target = rng.standard_normal((8, 4)).astype("float32"), rng.standard_normal((8, 1)).astype("float32")
    if batch == "tensor":
        data, target = tf.constant(data), tf.constant(target)
    trainable = model.trainable_variables
    before = [v.numpy().copy() for v in trainable]
    batch_contexts = (di.Constant(model.non_trainable_variables), di.Constant(data), di.Constant(target))
    if backend.jit:  # a compiled graph takes the model as part of f (a Constant model is refused: identity)

        def f(trainable: list[Any], non_trainable: list[Any], data: Any, target: Any) -> Any:
            return keras_loss(trainable, model, non_trainable, data, target)

        contexts: tuple[Any, ...] = batch_contexts
    else:
        f, contexts = keras_loss, (di.Constant(model), *batch_contexts)
    grads = di.gradient(f, backend, trainable, *contexts)
    with tf.GradientTape() as tape:
        expected = tape.gradient(tf.reduce_mean((model(tf.constant(data)) - target) ** 2), trainable)
    assert isinstance(grads, list) and len(grads) == len(trainable)
    for g, e, v in zip(grads, expected, trainable, strict=True):
        assert isinstance(g, tf.Tensor) and g.dtype == tf.float32 and tuple(g.shape) == tuple(v.shape)
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
    for v, b in zip(trainable, before, strict=True):
        np.testing.assert_array_equal(v.numpy(), b)
    report = check_gradients(f, trainable, *contexts)
    assert not report.failed and report.counts().get("passed", 0) >= 1, report


@pytest.mark.parametrize("backend", BACKENDS)
def test_f_reading_the_variables_of_x_itself_is_refused(backend: di.Backend) -> None:
    """x's variables reach f as tensors, which the tape differentiates: an f that reads the
    variables themselves (``model(data)`` with x the model's trainable variables, a closure over
    a ``tf.Variable`` of x) got a zero or partial derivative with no error."""
    model = _keras_model()
    data = tf.constant(np.random.default_rng(0).standard_normal((8, 4)).astype("float32"))
    trainable = model.trainable_variables
    ones = [tf.ones_like(v) for v in trainable]
    forward = lambda trainable: tf.reduce_mean(model(data) ** 2)  # noqa: E731
    with pytest.raises(di.InvalidOutputError, match=r"dense_?\d*/kernel"):
        di.gradient(forward, backend, trainable)
    with pytest.raises(di.InvalidOutputError, match="stateless_call"):
        di.hvp(forward, backend, trainable, ones)
    with pytest.raises(di.InvalidOutputError, match="reads the variables"):
        di.jvp(lambda trainable: model(data), backend, trainable, ones)
    v = tf.Variable([1.0, 2.0], dtype=tf.float64)
    with pytest.raises(di.InvalidOutputError, match="reads the variables"):
        di.gradient(lambda x: tf.reduce_sum(v**2 * x), backend, v)  # (d/dv of v**3 is 3 v**2)
    # the tensors f is given are differentiated as before, and a variable apart from x is a constant
    w = tf.Variable([3.0, 4.0], dtype=tf.float64)
    np.testing.assert_allclose(di.gradient(lambda x: tf.reduce_sum(w * x**2), backend, v).numpy(), [6.0, 16.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_in_numpy_out_and_float64_kept(backend: di.Backend) -> None:
    x = np.array([0.1, 0.2, 0.3])  # float64: a float32 computation would miss by ~1e-8
    grad = di.gradient(loss, backend, x)
    assert type(grad) is np.ndarray and grad.dtype == np.float64
    np.testing.assert_allclose(grad, loss_grad(x), rtol=1e-13)
    assert isinstance(di.gradient(loss, backend, 0.5), float)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_python_float_beside_float32_tensors_takes_their_dtype(backend: di.Backend) -> None:
    """A Python float at a leaf of x became a float64 tensor, and f's product with x's float32
    tensor raised TensorFlow's own InvalidArgumentError: it now takes the tensors' dtype, as
    f's own call on x computes with it."""
    x = {"v": tf.constant([1.0, 2.0]), "b": 1.5}

    def f(t: Any) -> Any:
        return t["v"] * t["b"]

    value, grad = di.value_and_gradient(lambda t: tf.reduce_sum(f(t)), backend, x)
    assert value.dtype == f(x).dtype == tf.float32
    assert type(grad["b"]) is float and grad["b"] == pytest.approx(3.0, rel=1e-6)
    assert grad["v"].dtype == tf.float32
    np.testing.assert_allclose(grad["v"].numpy(), [1.5, 1.5])
    assert di.jacobian(f, backend, x)["b"].dtype == tf.float32
    pushed = di.jvp(f, backend, x, {"v": tf.ones(2), "b": 1.0})
    np.testing.assert_allclose(pushed.numpy(), [2.5, 3.5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_operator_on_a_tensor(backend: di.Backend) -> None:
    x = tf.constant([0.4, -0.7], dtype=tf.float64)
    v = tf.constant([1.0, 2.0], dtype=tf.float64)
    xn, vn = x.numpy(), v.numpy()
    second = 2 * np.sin(xn) + 4 * xn * np.cos(xn) - xn**2 * np.sin(xn)
    np.testing.assert_allclose(di.hvp(loss, backend, x, v).numpy(), second * vn, rtol=1e-12)
    np.testing.assert_allclose(di.hessian(loss, backend, x).numpy(), np.diag(second), rtol=1e-12)
    vector = lambda x: tf.sin(x) * x  # noqa: E731
    jac = np.diag(np.cos(xn) * xn + np.sin(xn))
    np.testing.assert_allclose(di.jacobian(vector, backend, x).numpy(), jac, rtol=1e-12)
    np.testing.assert_allclose(di.jvp(vector, backend, x, v).numpy(), jac @ vn, rtol=1e-12)
    np.testing.assert_allclose(di.vjp(vector, backend, x, v).numpy(), jac.T @ vn, rtol=1e-12)
    t = tf.constant(0.3, dtype=tf.float64)
    np.testing.assert_allclose(di.second_derivative(lambda t: t**4, backend, t).numpy(), 12 * 0.3**2, rtol=1e-12)


# -- refusals and the contract ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_custom_gradient_holds_in_forward_products_too(backend: di.Backend) -> None:
    """tf.autodiff.ForwardAccumulator differentiates a tf.custom_gradient's forward operations,
    not its rule: a jvp and a derivative of a straight-through rounding were 0 (1 eagerly, of a
    rule that scales by 10) where the gradient, vjp and Jacobian follow the rule."""

    @tf.custom_gradient
    def straight_through(v: Any) -> Any:
        return tf.round(v), lambda dy: dy

    @tf.custom_gradient
    def scaled(v: Any) -> Any:
        return tf.identity(v), lambda dy: 10.0 * dy

    x = tf.constant([0.3, 1.7], tf.float64)
    t = tf.constant([1.0, -2.0], tf.float64)
    for rule, factor in ((straight_through, 1.0), (scaled, 10.0)):
        assert np.allclose(di.jvp(rule, backend, x, t).numpy(), factor * t.numpy())
        assert np.allclose(di.derivative(rule, backend, tf.constant(0.3, tf.float64)).numpy(), factor)
        assert np.allclose(di.vjp(rule, backend, x, t).numpy(), factor * t.numpy())
        assert np.allclose(di.jacobian(rule, backend, x).numpy(), factor * np.eye(2))


def test_jit_control_flow_has_forward_products_and_unknown_shapes_are_refused() -> None:
    """Under jit, a ForwardAccumulator through tf.map_fn, tf.scan or tf.while_loop raised
    TensorFlow's TypeError (a variant dtype); the jvp and hvp now agree with eager mode's. A graph
    output of unknown shape (tf.py_function, tf.boolean_mask) and float(y) raised raw Python
    errors from diffiface's own checks; they are refused by name."""
    eager, jit = di.AutoTensorFlow(), di.AutoTensorFlow(jit=True)
    x = tf.constant([0.5, -1.0, 1.5], tf.float64)
    t = tf.constant([1.0, 2.0, -1.0], tf.float64)

    def mapped(v: Any) -> Any:
        return tf.map_fn(lambda a: a**3, v)

    def looped(v: Any) -> Any:
        _, out = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.sin(a) * v), (0, v))
        return tf.reduce_sum(out**2)

    np.testing.assert_allclose(di.jvp(mapped, jit, x, t).numpy(), 3 * x.numpy() ** 2 * t.numpy())
    np.testing.assert_allclose(di.hvp(looped, jit, x, t).numpy(), di.hvp(looped, eager, x, t).numpy(), rtol=1e-12)
    with pytest.raises(di.InvalidOutputError, match="does not know its shape"):
        di.gradient(lambda v: tf.py_function(lambda a: tf.reduce_sum(tf.sin(a)), [v], tf.float64), jit, x)
    with pytest.raises(di.InvalidOutputError, match="does not know its shape"):
        di.jacobian(lambda v: tf.boolean_mask(v, v > 0) ** 2, jit, x)
    with pytest.raises(di.DiffifaceError, match="converts a tensor to a Python number"):
        di.gradient(lambda v: float(tf.reduce_sum(v)), jit, x)


def test_a_decorated_f_is_traced_op_by_op_under_jit() -> None:
    """Under jit a @tf.function f was one call operation in the prep's graph: a cut inside it
    (tf.stop_gradient of the whole output) read as a zero gradient. It is traced op by op now,
    with autograph as its decorator converts it (a Python branch on a tensor still works)."""
    jit = di.AutoTensorFlow(jit=True)
    x = tf.constant([1.0, 2.0], tf.float64)

    @tf.function
    def branchy(v: Any) -> Any:
        if tf.reduce_sum(v) > 0:
            return tf.reduce_sum(v**2)
        return tf.reduce_sum(v**3)

    @tf.function
    def cut(v: Any) -> Any:
        return tf.reduce_sum(tf.stop_gradient(v) ** 2)

    np.testing.assert_allclose(di.gradient(branchy, jit, x).numpy(), [2.0, 4.0])
    np.testing.assert_allclose(di.gradient(branchy, jit, -x).numpy(), [3.0, 12.0])
    with pytest.raises(di.InvalidOutputError, match="does not differentiate"):
        di.gradient(cut, jit, x)


def test_a_value_cut_from_the_tape_is_refused() -> None:
    def cut(x: Any) -> Any:
        return tf.constant(tf.reduce_sum(x**2).numpy())

    with pytest.raises(di.InvalidOutputError, match="not through the tensorflow engine's trace"):
        di.gradient(cut, "tensorflow", tf.constant([1.0, 2.0]))
    with pytest.raises(di.InvalidOutputError):
        di.jvp(lambda x: tf.constant((x**2).numpy()), "tensorflow", tf.constant([1.0, 2.0]), tf.ones(2))


def test_an_output_that_does_not_depend_on_x_has_zero_derivative() -> None:
    grad = di.gradient(lambda x: tf.constant(3.0), "tensorflow", tf.constant([1.0, 2.0]))
    np.testing.assert_array_equal(grad.numpy(), np.zeros(2))
    grad = di.gradient(lambda x: 3.0, "tensorflow", tf.constant([1.0, 2.0]))
    np.testing.assert_array_equal(grad.numpy(), np.zeros(2))


def test_assigning_to_a_constant_variable_is_refused_and_nothing_changes() -> None:
    state = tf.Variable([1.0, 2.0])

    def writes(x: Any, state: Any) -> Any:
        state.assign(state * 2)
        return tf.reduce_sum(x * state)

    with pytest.raises(di.MutationError, match="assigns"):
        di.gradient(writes, "tensorflow", tf.constant([1.0, 1.0]), di.Constant(state))
    np.testing.assert_array_equal(state.numpy(), [1.0, 2.0])


def test_jit_takes_new_context_values_without_a_stale_graph() -> None:
    backend = di.AutoTensorFlow(jit=True)
    x = tf.constant([0.5, 1.5])
    prep = di.prepare_gradient(loss, backend, x, di.Constant(2.0))
    for scale in (2.0, 3.0):
        grad = di.gradient(loss, backend, x, di.Constant(scale), prep=prep)
        np.testing.assert_allclose(grad.numpy(), loss_grad(x.numpy().astype(np.float64), scale), rtol=1e-5)
    data = np.array([1.0, -1.0], dtype="float32")
    g = lambda x, d: tf.reduce_sum(x * d)  # noqa: E731
    prep = di.prepare_gradient(g, backend, x, di.Constant(data))
    np.testing.assert_array_equal(di.gradient(g, backend, x, di.Constant(data), prep=prep).numpy(), data)
    np.testing.assert_array_equal(di.gradient(g, backend, x, di.Constant(-data), prep=prep).numpy(), -data)


def test_jit_takes_a_float_beside_leaves_of_two_dtypes() -> None:
    # (a float made a tensor of x's first leaf's dtype met the float64 leaf: TensorFlow's TypeError)
    x = {"a": tf.constant([1.0, 2.0], tf.float32), "b": tf.constant([3.0], tf.float64)}

    def f(x: Any, s: Any) -> Any:
        return tf.reduce_sum(x["a"] * s) + tf.cast(tf.reduce_sum(x["b"] * s), tf.float32)

    backend = di.AutoTensorFlow(jit=True)
    prep = di.prepare_gradient(f, backend, x, di.Constant(0.1))
    for s in (0.1, 0.3):
        grad = di.gradient(f, backend, x, di.Constant(s), prep=prep)
        np.testing.assert_allclose(grad["a"].numpy(), [s, s], rtol=1e-6)
        assert grad["b"].numpy()[0] == s  # the float64 leaf's derivative in float64


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_jit_keeps_a_float_a_python_number(dtype: str) -> None:
    # expected: f's arithmetic on a float Constant is Python's, as without jit and as
    # tf.function keeps a Python number (a tensor of x's dtype made first gave 0.125 for the
    # float32 derivative 1000000.1 - 1e6 = 0.1, and inf for float16's 70000 / 1000 = 70);
    # a float64 cast inside f meets a Python float, not a float32 tensor (TypeError before)
    x = tf.constant([0.5, -1.0], dtype)
    offset = 1e6 if dtype == "float32" else 0.0
    c, want = (1000000.1, 0.1) if dtype == "float32" else (70000.0, 70.0)

    def f(v: Any, c: Any) -> Any:
        return tf.reduce_sum(v * ((c - offset) if dtype == "float32" else c / 1000.0))

    def g(v: Any, c: Any) -> Any:
        return tf.cast(tf.reduce_sum(tf.cast(v, tf.float64) * c), v.dtype)

    for backend in ("tensorflow", di.AutoTensorFlow(jit=True)):
        grad = di.gradient(f, backend, x, di.Constant(c)).numpy()
        np.testing.assert_allclose(grad, [want, want], rtol=1e-3)
        np.testing.assert_allclose(di.gradient(g, backend, x, di.Constant(2.5)).numpy(), [2.5, 2.5])


def test_jit_refuses_a_model_as_a_constant() -> None:
    model = _keras_model()
    with pytest.raises(di.ContextError, match="static"):
        di.gradient(
            keras_loss,
            di.AutoTensorFlow(jit=True),
            model.trainable_variables,
            di.Constant(model),
            di.Constant([]),
            di.Constant(tf.ones((2, 4))),
            di.Constant(tf.ones((2, 1))),
        )


def test_jit_explains_numpy_inside_the_graph() -> None:
    with pytest.raises(di.FrameworkMismatchError, match="jit=False"):
        di.gradient(lambda x: tf.reduce_sum(x) + float(np.sum(x.numpy())), di.AutoTensorFlow(jit=True), tf.ones(2))


def test_preparation_is_strict() -> None:
    prep = di.prepare_gradient(loss, "tensorflow", tf.ones(3))
    with pytest.raises(di.PreparationMismatchError, match="tensorflow"):
        di.gradient(loss, "tensorflow", tf.ones(4), prep=prep)


# -- complex numbers: the project's convention (torch's) ------------------------------------------


Z = np.array([3 + 4j, 0.5 - 1.25j])


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_gradient_is_the_convention(backend: di.Backend) -> None:
    z = tf.constant(Z)
    grad = di.gradient(lambda z: tf.reduce_sum(tf.math.real(z * tf.math.conj(z))), backend, z)
    np.testing.assert_allclose(grad.numpy(), 2 * Z)  # |z|^2 at 3+4j -> 6+8j
    w = np.array([0.5 + 1j, -2 + 0.25j])
    grad = di.gradient(lambda z: tf.reduce_sum(tf.math.real(z * z * w)), backend, z)
    np.testing.assert_allclose(grad.numpy(), np.conj(2 * Z * w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_jvp_vjp_and_hvp_agree_with_torch(backend: di.Backend) -> None:
    torch = pytest.importorskip("torch")
    v = np.array([1 - 0.5j, 0.25 + 2j])

    def tf_f(z: Any) -> Any:
        return tf.exp(z) * tf.math.conj(z)

    def torch_f(z: Any) -> Any:
        return torch.exp(z) * torch.conj(z)

    z, zt, vt = tf.constant(Z), torch.tensor(Z), torch.tensor(v)
    np.testing.assert_allclose(
        di.jvp(tf_f, backend, z, tf.constant(v)).numpy(), di.jvp(torch_f, "torch", zt, vt).numpy()
    )
    np.testing.assert_allclose(
        di.vjp(tf_f, backend, z, tf.constant(v)).numpy(), di.vjp(torch_f, "torch", zt, vt).numpy()
    )
    np.testing.assert_allclose(
        di.hvp(lambda z: tf.reduce_sum(tf.math.abs(z) ** 4), backend, z, tf.constant(v)).numpy(),
        di.hvp(lambda z: torch.sum(torch.abs(z) ** 4), "torch", zt, vt).numpy(),
    )


def test_check_gradients_picks_tensorflow_for_tensorflow_arrays() -> None:
    report = check_gradients(loss, tf.constant([0.3, -0.4], dtype=tf.float64))
    assert not report.failed, report
    assert [row.backend for row in report.rows if row.status == "passed"] == ["tensorflow"], report


def test_check_gradients_catches_a_wrong_tensorflow_rule() -> None:
    """TensorFlow tensors in x are inputs of the ground truth: they were left out of it, as
    leaves of no array kind it knew, so every TensorFlow x passed with nothing compared (3
    evaluations of f), a rule 1% off included."""

    @tf.custom_gradient
    def squares(v: Any) -> Any:
        return tf.reduce_sum(v**2), lambda g: g * 2.02 * v  # the bug: 2.02, where the derivative has 2

    def right(v: Any) -> Any:
        return tf.reduce_sum(v[0] ** 2) + tf.reduce_sum(tf.sin(v[1]))

    def wrong(v: Any) -> Any:
        return squares(v[0]) + tf.reduce_sum(tf.sin(v[1]))

    for dtype in (tf.float64, tf.float32):
        x = [tf.constant([0.5, -1.0, 2.0], dtype=dtype), tf.Variable([0.3, 0.7], dtype=dtype)]
        report = check_gradients(right, x, backends="tensorflow")
        assert [row.status for row in report.rows] == ["passed"], report
        with pytest.raises(di.GradientCheckError, match=r"x\[0\]: [23] of 3 entries differ"):
            check_gradients(wrong, x, backends="tensorflow")


# -- cross-framework: a TensorFlow f inside jax and torch ---------------------------------------------


def scaled(x: Any, scale: Any) -> Any:
    return tf.reduce_sum(scale * tf.sin(x) * x)


X = np.array([0.3, -1.0, 2.0])
FIRST = 2 * (np.cos(X) * X + np.sin(X))
SECOND = 2 * (2 * np.cos(X) - X * np.sin(X))


def test_differentiate_with_inside_jax() -> None:
    jax = pytest.importorskip("jax")
    g = di.differentiate_with(scaled, "tensorflow")
    x = jax.numpy.asarray(X, dtype="float32")
    np.testing.assert_allclose(jax.grad(lambda x: g(x, di.Constant(2.0)))(x), FIRST, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: g(x, di.Constant(2.0))))(x), FIRST, rtol=1e-5)
    hessian = jax.hessian(lambda x: g(x, di.Constant(2.0)))(x)
    np.testing.assert_allclose(np.asarray(hessian), np.diag(SECOND), rtol=1e-4, atol=1e-6)
    h = di.differentiate_with(lambda x: tf.sin(x) * x, "tensorflow")
    expected = np.diag(FIRST / 2)
    np.testing.assert_allclose(jax.jacrev(h)(x), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.jacfwd(h)(x), expected, rtol=1e-5, atol=1e-7)


def test_differentiate_with_inside_torch() -> None:
    torch = pytest.importorskip("torch")
    g = di.differentiate_with(scaled, "tensorflow")
    x = torch.tensor(X, requires_grad=True)
    (grad,) = torch.autograd.grad(g(x, di.Constant(2.0)), x, create_graph=True)
    np.testing.assert_allclose(grad.detach().numpy(), FIRST, rtol=1e-12)
    (second,) = torch.autograd.grad(grad.sum(), x)
    np.testing.assert_allclose(second.numpy(), SECOND, rtol=1e-10)
    h = di.differentiate_with(lambda x: tf.sin(x) * x, "tensorflow")
    with warnings.catch_warnings():  # (torch's forward mode scripts its decompositions on first use)
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        _, tangent = torch.func.jvp(h, (torch.tensor(X),), (torch.ones(3, dtype=torch.float64),))
    np.testing.assert_allclose(tangent.numpy(), FIRST / 2, rtol=1e-12)


@pytest.mark.parametrize("jit", [False, True])
def test_a_constant_that_is_x_itself_is_not_differentiated(jit: bool) -> None:
    """Eager, a tape watches tensors by identity: a Constant that is x's own tensor object must
    stay a constant."""
    x = tf.constant([0.3, 1.2], dtype=tf.float64)
    f = lambda v, c: tf.reduce_sum(tf.sin(v) * v * c)  # noqa: E731
    got = di.gradient(f, di.AutoTensorFlow(jit=jit), x, di.Constant(x))
    xn = x.numpy()
    np.testing.assert_allclose(got.numpy(), (np.cos(xn) * xn + np.sin(xn)) * xn, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_tensor_at_two_leaves_of_x_or_closed_over_is_x_alone(backend: di.Backend) -> None:
    """A tape and an accumulator watch tensors by identity: one tensor at two leaves of x (shared
    zero-initialised biases), or x's tensor closed over by f, must be differentiated as x's
    leaves alone."""
    zeros = tf.zeros(3, dtype=tf.float64)
    params = {"b1": zeros, "b2": zeros}
    f = lambda p: tf.reduce_sum(2 * p["b1"] + 3 * p["b2"] + p["b1"] * p["b2"])  # noqa: E731
    got = di.gradient(f, backend, params)
    np.testing.assert_allclose(got["b1"].numpy(), [2.0] * 3)
    np.testing.assert_allclose(got["b2"].numpy(), [3.0] * 3)
    ones = {"b1": tf.ones(3, dtype=tf.float64), "b2": tf.ones(3, dtype=tf.float64)}
    assert float(di.jvp(f, backend, params, ones)) == pytest.approx(15.0)
    hessian = di.hessian(f, backend, params)
    np.testing.assert_allclose(hessian["b1"]["b2"].numpy(), np.eye(3))
    np.testing.assert_allclose(hessian["b1"]["b1"].numpy(), np.zeros((3, 3)))
    w0 = tf.constant([0.5, -1.5], dtype=tf.float64)
    closed = lambda w: tf.reduce_sum(w * w0)  # noqa: E731
    np.testing.assert_allclose(di.gradient(closed, backend, w0).numpy(), w0.numpy())
    np.testing.assert_allclose(di.hessian(closed, backend, w0).numpy(), np.zeros((2, 2)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_embedding_lookup_has_an_hvp(backend: di.Backend) -> None:
    """A gather's gradient, and its tangent, come as tf.IndexedSlices: made dense."""
    table = tf.constant(np.arange(12.0).reshape(4, 3) / 10)
    index = tf.constant([0, 2, 2, 3])
    f = lambda e: tf.reduce_sum(tf.gather(e, index) ** 2)  # noqa: E731
    counts = np.array([1.0, 0.0, 2.0, 1.0])[:, None]
    got = di.hvp(f, backend, table, tf.ones_like(table))
    np.testing.assert_allclose(got.numpy(), 2 * counts * np.ones((4, 3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scatter_has_an_hvp_and_a_hessian(backend: di.Backend) -> None:
    """Forward over reverse through tf.tensor_scatter_nd_update raised TensorFlow's
    AttributeError ('IndexedSlices' has no '_id'); reverse over reverse serves it.
    f = x0**4 + x0**6 + x2**4 + x1**6."""
    x = tf.constant([0.5, -1.0, 1.5, 2.0], tf.float64)
    f = lambda v: tf.reduce_sum(tf.tensor_scatter_nd_update(v**2, [[1], [3]], v[:2] ** 3) ** 2)  # noqa: E731
    v = x.numpy()
    diagonal = np.array([12 * v[0] ** 2 + 30 * v[0] ** 4, 30 * v[1] ** 4, 12 * v[2] ** 2, 0.0])
    np.testing.assert_allclose(di.hessian(f, backend, x).numpy(), np.diag(diagonal))
    np.testing.assert_allclose(di.hvp(f, backend, x, tf.ones(4, tf.float64)).numpy(), diagonal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float_cotangent_takes_the_output_dtype(backend: di.Backend) -> None:
    x = tf.constant([1.0, 2.0])  # float32
    got = di.vjp(lambda v: tf.reduce_sum(v**2), backend, x, 1.0)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), [2.0, 4.0])
    pair = di.vjp(lambda v: (tf.reduce_sum(v), 3 * v), backend, x, (2.0, tf.ones(2)))
    np.testing.assert_allclose(pair.numpy(), [5.0, 5.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_output_apart_from_x_or_cut_from_it(backend: di.Backend) -> None:
    """An output that does not depend on x has a zero derivative, in a graph too; one that x
    reaches only through a numpy function or a stop_gradient would read as zero: refused."""
    x = tf.constant([1.0, 2.0])
    c = di.Constant(tf.constant([3.0, 4.0]))
    np.testing.assert_allclose(di.gradient(lambda v, k: tf.reduce_sum(k), backend, x, c).numpy(), [0.0, 0.0])
    np.testing.assert_allclose(di.jvp(lambda v, k: k * 2.0, backend, x, tf.ones(2), c).numpy(), [0.0, 0.0])
    partial = di.gradient(lambda v, k: tf.reduce_sum(tf.stop_gradient(v) * v), backend, x, c)
    np.testing.assert_allclose(partial.numpy(), [1.0, 2.0])
    cuts = [
        lambda v, k: tf.reduce_sum(tf.numpy_function(lambda a: a * 2, [v], tf.float32) * k),
        lambda v, k: tf.reduce_sum(tf.stop_gradient(v) * k),
    ]
    for cut in cuts:
        with pytest.raises(di.InvalidOutputError, match="derivative would read as"):
            di.gradient(cut, backend, x, c)


def test_a_cut_under_the_callers_tape_is_refused() -> None:
    """Whether any tape records f's output does not say this call's tape does: under the
    caller's tape watching a Constant, a value cut from x (``.numpy()``) is still refused, and an
    output apart from x still has a zero gradient."""
    x = tf.constant([1.0, 2.0])
    c = tf.constant(3.0)
    cut = lambda v, k: tf.constant(tf.reduce_sum(v**2).numpy()) * k  # noqa: E731
    with tf.GradientTape() as tape:
        tape.watch(c)
        with pytest.raises(di.InvalidOutputError, match="changes with x"):
            di.gradient(cut, "tensorflow", x, di.Constant(c))
        np.testing.assert_allclose(di.gradient(lambda v, k: k * 2.0, "tensorflow", x, di.Constant(c)).numpy(), [0, 0])
        total = tf.reduce_sum(di.gradient(lambda v, k: tf.reduce_sum(v**2) * k, "tensorflow", x, di.Constant(c)))
    assert float(tape.gradient(total, c)) == pytest.approx(6.0)
    with pytest.raises(di.InvalidOutputError, match="changes with x"):
        di.gradient(lambda z: di.gradient(cut, "tensorflow", x, di.Constant(tf.reduce_sum(z)))[0], "tensorflow", x)


def test_a_cut_under_the_callers_tape_is_refused_by_every_product() -> None:
    """Under a caller's tape that watches a variable f reads, every output of f is recorded:
    a value cut from x gave a vjp, a Jacobian, a jvp and a derivative of zeros with no error
    (a vjp of ``x**2 * w`` cut at x = [1, 5], w = [2, 3]: [0, 0] where [4, 30] is right)."""
    w = tf.Variable([2.0, 3.0], dtype=tf.float64)
    x = tf.constant([1.0, 5.0], dtype=tf.float64)
    ones = tf.ones(2, dtype=tf.float64)
    cut = lambda v: tf.constant(v.numpy() ** 2) * w  # noqa: E731
    apart = lambda v: tf.stack([tf.reduce_sum(v**2), tf.reduce_sum(w)])  # noqa: E731
    with tf.GradientTape():
        for product in (
            lambda: di.vjp(cut, "tensorflow", x, ones),
            lambda: di.jacobian(cut, "tensorflow", x),
            lambda: di.jvp(cut, "tensorflow", x, ones),
            lambda: di.derivative(
                lambda s: tf.constant(s.numpy() ** 2) * w, "tensorflow", tf.constant(1.5, tf.float64)
            ),
        ):
            with pytest.raises(di.InvalidOutputError, match="changes with x"):
                product()
        # an output leaf apart from x has zero derivative beside one that depends on it
        split = lambda v: (v**2, w * 2.0)  # noqa: E731
        np.testing.assert_allclose(di.jacobian(apart, "tensorflow", x).numpy(), [[2.0, 10.0], [0.0, 0.0]])
        np.testing.assert_allclose(di.jvp(split, "tensorflow", x, ones)[1].numpy(), [0.0, 0.0])
        np.testing.assert_allclose(di.vjp(split, "tensorflow", x, (ones, ones)).numpy(), [2.0, 10.0])


def test_a_keras_model_constant_written_by_f_is_restored_and_refused() -> None:
    """A Keras model passed as a Constant reaches f as it is; TensorFlow keeps no count of a
    variable's writes, so a prep's first call compares the model's variables: BatchNormalization
    called with training=True is undone and refused by name; training=False is served."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    before = {variable.path: variable.numpy().copy() for variable in model.variables}
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))
    with pytest.raises(di.MutationError, match="moving_mean"):
        di.gradient(lambda v, m: tf.reduce_sum(m(v, training=True) ** 2), "tensorflow", x, di.Constant(model))
    for variable in model.variables:
        np.testing.assert_array_equal(variable.numpy(), before[variable.path])
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = tf.reduce_sum(model(x, training=False) ** 2)
    expected = tape.gradient(value, x)
    for _ in range(2):
        got = di.gradient(lambda v, m: tf.reduce_sum(m(v, training=False) ** 2), "tensorflow", x, di.Constant(model))
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)


def test_check_gradients_leaves_a_keras_model_constant_as_it_was() -> None:
    """The checker's own calls of f (x twice, then the finite differences of its ground truth)
    copied torch modules only: a Keras BatchNormalization called with training=True moved the
    caller's moving mean from 0 by up to about 0.2 while the TensorFlow engine refused the write. They
    watch the model as the engines do: put back and refused by name."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    before = {variable.path: variable.numpy().copy() for variable in model.variables}
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)))

    def loss(v: Any, m: Any) -> Any:
        return tf.reduce_sum(m(tf.cast(v, "float32"), training=True) ** 2)

    for point in (x, x.numpy()):
        with pytest.raises(di.MutationError, match="moving_mean"):
            check_gradients(loss, point, di.Constant(model))
        for variable in model.variables:
            np.testing.assert_array_equal(variable.numpy(), before[variable.path])


def test_a_keras_model_held_by_an_object_constant_is_restored_and_refused() -> None:
    """An object holding the model (``di.Constant(trainer)``): its variables were not watched."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    before = {variable.path: variable.numpy().copy() for variable in model.variables}

    class Trainer:
        def __init__(self, model: Any) -> None:
            self.model = model

    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))
    with pytest.raises(di.MutationError, match="moving_mean"):
        di.gradient(
            lambda v, t: tf.reduce_sum(t.model(v, training=True) ** 2), "tensorflow", x, di.Constant(Trainer(model))
        )
    for variable in model.variables:
        np.testing.assert_array_equal(variable.numpy(), before[variable.path])


def test_a_constant_model_is_watched_again_where_the_static_contexts_change() -> None:
    # expected: a MutationError, and the moving statistics unchanged, for a Constant model with a
    # BatchNormalization called with training=True after an unprepared call of the same loss on a
    # model without one (or with training=False): only a prep's first call was watched, and
    # unprepared calls of one f share a prep, so the statistics were updated with no error
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    normed = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))

    def loss(v: Any, model: Any, training: bool) -> Any:
        return tf.reduce_sum(model(v, training=training) ** 2)

    before = {variable.path: variable.numpy().copy() for variable in normed.variables}
    di.gradient(loss, "tensorflow", x, di.Constant(plain), di.Constant(True))
    with pytest.raises(di.MutationError, match="moving_mean"):
        di.gradient(loss, "tensorflow", x, di.Constant(normed), di.Constant(True))
    prep = di.prepare_gradient(loss, "tensorflow", x, di.Constant(normed), di.Constant(False))
    di.gradient(loss, "tensorflow", x, di.Constant(normed), di.Constant(False), prep=prep)
    with pytest.raises(di.MutationError, match="moving_mean"):
        di.gradient(loss, "tensorflow", x, di.Constant(normed), di.Constant(True), prep=prep)
    for variable in normed.variables:
        np.testing.assert_array_equal(variable.numpy(), before[variable.path])


def test_a_keras_model_cache_is_f_to_write() -> None:
    """A model passed as a di.Cache is f's scratch space: its writes are not refused."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))
    before = model.layers[1].moving_mean.numpy().copy()
    di.gradient(lambda v, m: tf.reduce_sum(m(v, training=True) ** 2), "tensorflow", x, di.Cache(model))
    assert not np.array_equal(model.layers[1].moving_mean.numpy(), before)


def test_a_keras_model_cache_is_left_as_f_leaves_it_at_x() -> None:
    # expected: after the first di.gradient (and di.hvp) with a BatchNormalization model as a
    # di.Cache, its moving statistics are those of one call of f at x, as TensorFlow's own step
    # leaves them; the check that f writes no value of x it reads back evaluated f again at a
    # point apart, which updated them a second time (moving_mean twice TensorFlow's)
    keras = pytest.importorskip("keras")
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))

    def model() -> Any:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])

    def loss(v: Any, m: Any) -> Any:
        return tf.reduce_sum(m(v, training=True) ** 2)

    for call in (
        lambda m: di.gradient(loss, "tensorflow", x, di.Cache(m)),
        lambda m: di.hvp(loss, "tensorflow", x, tf.ones_like(x), di.Cache(m)),
    ):
        ours, theirs = model(), model()
        call(ours)
        loss(x, theirs)
        for mine, expected in zip(ours.non_trainable_variables, theirs.non_trainable_variables, strict=True):
            np.testing.assert_allclose(mine.numpy(), expected.numpy(), rtol=1e-6, err_msg=mine.path)


def test_an_operation_without_a_derivative_is_named() -> None:
    """tf.unique has no gradient: TensorFlow's raw LookupError reached the caller."""
    x = tf.constant([1.0, 2.0, 1.0], tf.float64)
    for backend in (di.AutoTensorFlow(), di.AutoTensorFlow(jit=True)):
        with pytest.raises(di.UnsupportedOperationError, match=r"no derivative of an operation.*Unique"):
            di.gradient(lambda x: tf.reduce_sum(tf.unique(x)[0]), backend, x)


def test_jit_refusals_name_what_f_did() -> None:
    """Under jit a returned tf.Variable was blamed on a call inside tf.function, and an int output
    on tf.numpy_function; eagerly a random output that x does not reach names the generator."""
    x = tf.constant([1.0, 2.0], tf.float64)
    jit = di.AutoTensorFlow(jit=True)
    with pytest.raises(di.InvalidOutputError, match=r"returned a tf\.Variable"):
        di.jacobian(lambda x: tf.Variable(x * 2), jit, x)
    with pytest.raises(di.InvalidOutputError, match="dtype int32 where gradient needs floating-point"):
        di.gradient(lambda x: tf.reduce_sum(tf.cast(x, tf.int32)), jit, x)
    with pytest.raises(di.InvalidOutputError, match="global random generator"):
        di.gradient(lambda x: tf.reduce_sum(tf.random.normal((2,), dtype=tf.float64)), "tensorflow", x)


def test_recompute_grad_is_named_where_its_gradient_is_differentiated() -> None:
    # expected: the jvp (the pullback's adjoint) of an f using tf.recompute_grad raises an
    # UnsupportedOperationError naming it (TensorFlow's NotImplementedError came out raw); its
    # gradient is still served, and right
    @tf.recompute_grad
    def block(t: Any) -> Any:
        return tf.sin(t) * t

    x, v = tf.constant([0.3, -0.7], tf.float64), tf.constant([1.0, 0.5], tf.float64)
    for backend in ("tensorflow", di.AutoTensorFlow(jit=True)):
        with pytest.raises(di.UnsupportedOperationError, match=r"tf\.recompute_grad"):
            di.jvp(block, backend, x, v)
    grad = di.gradient(lambda t: tf.reduce_sum(block(t)), "tensorflow", x).numpy()
    np.testing.assert_allclose(grad, np.cos(x.numpy()) * x.numpy() + np.sin(x.numpy()))


def test_jit_serves_constant_and_piecewise_constant_outputs() -> None:
    # expected: under jit a Python number among f's outputs was sent to the eager cut probe (a
    # misleading "needs its values as numpy"), and one_hot(argmax(x)) was taken for a cut (its
    # path from x runs through an integer); both are served, as eagerly: zero blocks, a zero
    # gradient, v[argmax]'s unit vector; a stop_gradient of the output is still refused
    x = tf.constant([1.0, 3.0, 2.0], tf.float64)

    def hot(v: Any) -> Any:
        return tf.one_hot(tf.argmax(v), 3, dtype=tf.float64)

    for backend in ("tensorflow", di.AutoTensorFlow(jit=True)):
        square, constant = di.jacobian(lambda v: (v**2, 3.0), backend, x)
        np.testing.assert_array_equal(square.numpy(), np.diag([2.0, 6.0, 4.0]))
        np.testing.assert_array_equal(np.asarray(constant), np.zeros(3))
        np.testing.assert_array_equal(di.gradient(lambda v: tf.reduce_sum(hot(v)), backend, x).numpy(), [0, 0, 0])
        np.testing.assert_array_equal(di.gradient(lambda v: tf.reduce_sum(hot(v) * v), backend, x).numpy(), [0, 1, 0])
        with pytest.raises(di.InvalidOutputError):
            di.gradient(lambda v: tf.reduce_sum(tf.stop_gradient(v) * 2.0), backend, x)


def test_a_cache_variable_that_f_writes_from_x_and_reads_back_is_refused() -> None:
    """TensorFlow records no derivative through ``assign``: f writing 2 x into a Cache's variable
    and reading it back (``sum(x * cache)``) had the gradient 2 x where it is 4 x, with no error.
    A variable f only reads, or fills with values that do not move with x, is served."""
    x = tf.constant([0.3, -0.7], tf.float64)
    cache = tf.Variable(tf.zeros(2, tf.float64))

    def through(v: Any, c: Any) -> Any:
        c.assign(2 * v)
        return tf.reduce_sum(v * c)

    for call in (
        lambda: di.gradient(through, "tensorflow", x, di.Cache(cache)),
        lambda: di.jvp(lambda v, c: through(v, c) * v, "tensorflow", x, tf.ones_like(x), di.Cache(cache)),
        lambda: di.hvp(through, "tensorflow", x, tf.ones_like(x), di.Cache(cache)),
    ):
        with pytest.raises(di.InvalidOutputError, match="reads them back"):
            call()

    def reset(v: Any, c: Any) -> Any:
        c.assign(tf.ones(2, tf.float64))  # (the same at any x: a constant of f)
        return tf.reduce_sum(v**2 * c)

    np.testing.assert_allclose(di.gradient(reset, "tensorflow", x, di.Cache(cache)).numpy(), 2 * x.numpy())
    cache.assign([3.0, 5.0])
    got = di.gradient(lambda v, c: tf.reduce_sum(v * c), "tensorflow", x, di.Cache(cache))
    np.testing.assert_allclose(got.numpy(), [3.0, 5.0])


def test_second_order_serves_a_cache_variable_that_f_reads_and_a_nested_gradient() -> None:
    # expected: the hvp, Hessian and second derivative of sum(x**3 * c), c a Cache's variable
    # that f only reads (a Keras model's kernel), are those of 6 x c; they were refused as a cut
    # ("not through the tensorflow engine's trace"), as was the hvp of an f whose nested
    # di.gradient is constant in x: f evaluated again at a point apart with TensorFlow's
    # recording stopped stopped the tapes of the gradient inside it too
    x, v = tf.constant([1.0, 2.0], tf.float64), tf.constant([1.0, 0.5], tf.float64)
    cache = tf.Variable([1.0, 2.0], dtype=tf.float64)

    def cubic(u: Any, c: Any) -> Any:
        return tf.reduce_sum(u**3 * c)

    np.testing.assert_allclose(di.hvp(cubic, "tensorflow", x, v, di.Cache(cache)).numpy(), [6.0, 12.0])
    np.testing.assert_allclose(di.hessian(cubic, "tensorflow", x, di.Cache(cache)).numpy(), np.diag([6.0, 24.0]))
    second = di.second_derivative(lambda s, c: cubic(s * tf.ones(2, tf.float64), c), "tensorflow", 2.0, di.Cache(cache))
    assert second == pytest.approx(36.0)
    np.testing.assert_array_equal(cache.numpy(), [1.0, 2.0])

    def nested(u: Any) -> Any:  # sum of the gradient of a linear map: 6, at any u
        return tf.reduce_sum(di.gradient(lambda w: tf.reduce_sum(3.0 * w), "tensorflow", u))

    np.testing.assert_array_equal(di.hvp(nested, "tensorflow", x, v).numpy(), [0.0, 0.0])


def test_finite_differences_refuse_a_write_into_a_tensorflow_constant() -> None:
    # expected: a MutationError, the variables as they were; finite differences handed f the
    # caller's tf.Variable itself, and an f adding 1 to it at each evaluation got the gradient
    # -165136 where [1, 2] is its value (the variable left at [6, 7]); a Keras model's
    # BatchNormalization called with training=True updated its statistics at each evaluation
    keras = pytest.importorskip("keras")
    variable = tf.Variable([1.0, 2.0], dtype=tf.float64)

    def shifting(v: Any, c: Any) -> Any:
        c.assign_add(tf.ones_like(c))
        return tf.reduce_sum(v * c)

    with pytest.raises(di.MutationError, match="assigns into"):
        di.gradient(shifting, "finite_differences", tf.constant([1.0, 1.0], tf.float64), di.Constant(variable))
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))
    before = {v.path: v.numpy().copy() for v in model.variables}
    with pytest.raises(di.MutationError, match="moving_mean"):
        di.gradient(lambda v, m: tf.reduce_sum(m(v, training=True) ** 2), "finite_differences", x, di.Constant(model))
    for v in model.variables:
        np.testing.assert_array_equal(v.numpy(), before[v.path])
    got = di.gradient(
        lambda v, m: tf.reduce_sum(m(v, training=False) ** 2), "finite_differences", x, di.Constant(model)
    )
    assert isinstance(got, tf.Tensor) and got.shape == x.shape
