"""The layer zoo: neural-network layers written once, differentiable by every engine.

Each layer is a loss ``loss(params, config, data, state) -> scalar`` written against the array
namespace of its parameters, so the same code runs when the parameter leaves are numpy arrays,
torch tensors, jax arrays (jax tracers included, under ``jax.grad`` or ``jax.jit``) or autograd
``ArrayBox`` objects. ``data`` and ``state`` leaves may be numpy arrays or arrays of the
parameters' framework; floating ones are converted to the parameters' dtype.

The layers use only this subset of the array API, together with arithmetic operators, unary minus,
basic slicing with positive steps, integer indexing and the ``shape``/``ndim``/``dtype``
attributes:

``asarray``, ``concat``, ``exp``, ``flip``, ``matmul``, ``max``, ``mean``, ``permute_dims``,
``reshape``, ``sqrt``, ``stack``, ``sum``, ``take``, ``tanh``, ``zeros_like``.

Broadcasting never promotes rank implicitly (a bias is reshaped to its operand's rank first) and
Python scalars are the only weakly typed operands, so the layers run under jax's
``jax_numpy_rank_promotion="raise"`` and ``jax_numpy_dtype_promotion="strict"``. No in-place
operation, no item assignment and no framework-specific call appears, which is why
convolution is written through im2col (strided slices, ``stack`` and ``matmul``), pooling through
``reshape`` and a reduction, and transposed convolution through zero insertion.

The module imports numpy only; array frameworks are imported on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy

from .._errors import FrameworkMismatchError

__all__ = ["LayerCase", "layer_cases", "namespace"]

Loss = Callable[..., Any]

#: The array-API functions the layers call; the autograd namespace provides exactly these.
ARRAY_API_FUNCTIONS = (
    "asarray",
    "concat",
    "exp",
    "flip",
    "matmul",
    "max",
    "mean",
    "permute_dims",
    "reshape",
    "sqrt",
    "stack",
    "sum",
    "take",
    "tanh",
    "zeros_like",
)


# --------------------------------------------------------------------------------------------
# Namespaces


def _is_autograd_box(value: Any) -> bool:
    # Checked by module name so that asking never imports autograd.
    return type(value).__module__.startswith("autograd")


class _AutogradNamespace:
    """The array-API functions the layers use, built on ``autograd.numpy``.

    autograd has no array-API namespace of its own, and its ``flip`` and ``take`` have no
    derivative, so those two go through indexing, which autograd does differentiate.
    """

    __name__ = "diffiface.test._layers.autograd_namespace"

    def __init__(self) -> None:
        import autograd.numpy

        self._np = autograd.numpy

    def asarray(self, obj: Any, /, *, dtype: Any = None, device: Any = None, copy: Any = None) -> Any:
        if _is_autograd_box(obj):
            return obj if dtype is None or obj.dtype == dtype else obj.astype(dtype)
        return numpy.asarray(obj, dtype=dtype)

    def astype(self, x: Any, dtype: Any, /) -> Any:
        return x.astype(dtype)

    def concat(self, arrays: Any, /, *, axis: int = 0) -> Any:
        return self._np.concatenate(list(arrays), axis=axis)

    def exp(self, x: Any, /) -> Any:
        return self._np.exp(x)

    def flip(self, x: Any, /, *, axis: int | tuple[int, ...] | None = None) -> Any:
        axes = range(x.ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
        reverse = {a % x.ndim for a in axes}
        return x[tuple(slice(None, None, -1) if a in reverse else slice(None) for a in range(x.ndim))]

    def matmul(self, x1: Any, x2: Any, /) -> Any:
        return self._np.matmul(x1, x2)

    def max(self, x: Any, /, *, axis: Any = None, keepdims: bool = False) -> Any:
        return self._np.max(x, axis=axis, keepdims=keepdims)

    def mean(self, x: Any, /, *, axis: Any = None, keepdims: bool = False) -> Any:
        return self._np.mean(x, axis=axis, keepdims=keepdims)

    def permute_dims(self, x: Any, /, axes: tuple[int, ...]) -> Any:
        return self._np.transpose(x, axes)

    def reshape(self, x: Any, /, shape: tuple[int, ...], *, copy: Any = None) -> Any:
        return self._np.reshape(x, shape)

    def sqrt(self, x: Any, /) -> Any:
        return self._np.sqrt(x)

    def stack(self, arrays: Any, /, *, axis: int = 0) -> Any:
        return self._np.stack(list(arrays), axis=axis)

    def sum(self, x: Any, /, *, axis: Any = None, keepdims: bool = False) -> Any:
        return self._np.sum(x, axis=axis, keepdims=keepdims)

    def take(self, x: Any, indices: Any, /, *, axis: int | None = None) -> Any:
        if axis is None:
            return self._np.reshape(x, (-1,))[indices]
        return x[(slice(None),) * (axis % x.ndim) + (indices,)]

    def tanh(self, x: Any, /) -> Any:
        return self._np.tanh(x)

    def zeros_like(self, x: Any, /, *, dtype: Any = None, device: Any = None) -> Any:
        return self._np.zeros_like(x, dtype=dtype)


@functools.lru_cache(maxsize=1)
def _autograd_namespace() -> _AutogradNamespace:
    return _AutogradNamespace()


def namespace(*arrays: Any) -> Any:
    """Return the array namespace of ``arrays``.

    Parameters
    ----------
    *arrays
        numpy arrays, torch tensors, jax arrays (tracers included) or autograd ``ArrayBox``
        objects. Python scalars are ignored.

    Returns
    -------
    The ``array_api_compat`` namespace of the arrays, or, when any of them is an autograd
    ``ArrayBox``, a namespace built on ``autograd.numpy`` with the functions listed in
    ``ARRAY_API_FUNCTIONS``.

    Raises
    ------
    TypeError
        If no array is given, or arrays of different frameworks are mixed;
        :class:`~diffiface.FrameworkMismatchError` (a TypeError) where the arrays have no
        array-API namespace (an engine's symbolic values, such as PyTensor's graphs).
    """
    chosen = [a for a in arrays if not isinstance(a, (bool, int, float, complex))]
    if not chosen:
        raise TypeError("namespace() needs at least one array; it was given only Python scalars.")
    if any(_is_autograd_box(a) for a in chosen):
        foreign = {
            type(a).__name__
            for a in chosen
            if not _is_autograd_box(a) and not isinstance(a, (numpy.ndarray, numpy.generic))
        }
        if foreign:
            raise TypeError(
                f"autograd ArrayBoxes cannot be mixed with {sorted(foreign)}; "
                "convert every array to numpy or autograd first."
            )
        return _autograd_namespace()
    import array_api_compat

    try:
        return array_api_compat.array_namespace(*chosen)
    except TypeError as exc:  # (an engine whose values have no array-API namespace: pytensor's graphs)
        kinds = sorted({f"{type(a).__module__.split('.')[0]}.{type(a).__name__}" for a in chosen})
        raise FrameworkMismatchError(
            f"The layer is written for array-API arrays (numpy, torch, jax, autograd's boxes); it was "
            f"given {', '.join(kinds)}, which has no array-API namespace ({exc})."
        ) from exc


# --------------------------------------------------------------------------------------------
# Small helpers shared by the layers


def _leaves(tree: Any) -> Iterator[Any]:
    # Duck-typed on ``items`` because autograd hands a traced dict over as a DictBox.
    if hasattr(tree, "items"):
        for _, value in tree.items():
            yield from _leaves(value)
    else:
        yield tree


def _namespace_and_like(params: Any) -> tuple[Any, Any]:
    leaves = list(_leaves(params))
    return namespace(*leaves), leaves[0]


def _device_keywords(like: Any) -> dict[str, Any]:
    # Only torch places new arrays away from the default device; the others need no hint.
    if type(like).__module__.startswith("torch"):
        return {"device": like.device}
    return {}


def _float_array(xp: Any, value: Any, like: Any) -> Any:
    """``value`` as an array of ``like``'s framework, dtype and device."""
    return xp.asarray(value, dtype=like.dtype, **_device_keywords(like))


def _index_array(xp: Any, value: Any, like: Any) -> Any:
    """Integer ``value`` as an array of ``like``'s framework and device."""
    return xp.asarray(value, **_device_keywords(like))


def _transpose(xp: Any, matrix: Any) -> Any:
    return xp.permute_dims(matrix, (1, 0))


def _sigmoid(xp: Any, x: Any) -> Any:
    return 1 / (1 + xp.exp(-x))


def _activate(xp: Any, x: Any, activation: str) -> Any:
    if activation == "identity":
        return x
    if activation == "tanh":
        return xp.tanh(x)
    if activation == "sigmoid":
        return _sigmoid(xp, x)
    raise ValueError(f"unknown activation {activation!r}; expected 'identity', 'tanh' or 'sigmoid'.")


def _lift(xp: Any, array: Any, ndim: int) -> Any:
    """``array`` with leading axes of length 1 up to ``ndim`` axes.

    Broadcasting never relies on implicit rank promotion, which jax can be told to refuse.
    """
    return xp.reshape(array, (1,) * (ndim - array.ndim) + tuple(array.shape))


def _add_bias(xp: Any, y: Any, bias: Any) -> Any:
    return y + _lift(xp, bias, y.ndim)


def _linear(xp: Any, params: Any, x: Any) -> Any:
    y = xp.matmul(x, _transpose(xp, params["weight"]))
    return _add_bias(xp, y, params["bias"]) if "bias" in params else y


def _channel_vector(xp: Any, vector: Any) -> Any:
    """A per-channel vector shaped to broadcast against NCHW."""
    return xp.reshape(vector, (1, vector.shape[0], 1, 1))


def _pad2d(xp: Any, x: Any, top: int, bottom: int, left: int, right: int) -> Any:
    # The array API has no pad: concatenate zero rows and columns instead.
    if top or bottom:
        row = xp.zeros_like(x[:, :, :1, :])
        x = xp.concat([row] * top + [x] + [row] * bottom, axis=2)
    if left or right:
        column = xp.zeros_like(x[:, :, :, :1])
        x = xp.concat([column] * left + [x] + [column] * right, axis=3)
    return x


def _conv2d(
    xp: Any,
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: int = 1,
    padding: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> Any:
    """Cross-correlation of NCHW ``x`` with OIHW ``weight``, as torch's ``conv2d``, by im2col."""
    x = _pad2d(xp, x, *padding)
    n, channels, height, width = x.shape
    out_channels, _, kernel_h, kernel_w = weight.shape
    out_h = (height - kernel_h) // stride + 1
    out_w = (width - kernel_w) // stride + 1
    patches = [
        x[:, :, i : i + stride * (out_h - 1) + 1 : stride, j : j + stride * (out_w - 1) + 1 : stride]
        for i in range(kernel_h)
        for j in range(kernel_w)
    ]
    columns = xp.reshape(xp.stack(patches, axis=2), (n, channels * kernel_h * kernel_w, out_h, out_w))
    columns = xp.permute_dims(columns, (0, 2, 3, 1))
    kernel = xp.reshape(weight, (out_channels, channels * kernel_h * kernel_w))
    y = xp.matmul(columns, _transpose(xp, kernel))
    if bias is not None:
        y = _add_bias(xp, y, bias)
    return xp.permute_dims(y, (0, 3, 1, 2))


def _dilate(xp: Any, x: Any, stride: int, axis: int) -> Any:
    """Insert ``stride - 1`` zeros between neighbours along spatial ``axis`` (2 or 3)."""
    shape = tuple(x.shape)
    interleaved = xp.stack([x] + [xp.zeros_like(x)] * (stride - 1), axis=axis + 1)
    merged = (*shape[:axis], shape[axis] * stride, *shape[axis + 1 :])
    interleaved = xp.reshape(interleaved, merged)
    keep = (shape[axis] - 1) * stride + 1
    return interleaved[:, :, :keep, :] if axis == 2 else interleaved[:, :, :, :keep]


def _conv_transpose2d(xp: Any, x: Any, weight: Any, bias: Any, stride: int, padding: int, output_padding: int) -> Any:
    """Transposed convolution with IOHW ``weight``, as torch's ``conv_transpose2d``."""
    _, _, kernel_h, kernel_w = weight.shape
    if stride > 1:
        x = _dilate(xp, _dilate(xp, x, stride, axis=2), stride, axis=3)
    kernel = xp.permute_dims(xp.flip(weight, axis=(2, 3)), (1, 0, 2, 3))
    pad_h, pad_w = kernel_h - 1 - padding, kernel_w - 1 - padding
    pads = (pad_h, pad_h + output_padding, pad_w, pad_w + output_padding)
    return _conv2d(xp, x, kernel, bias, stride=1, padding=pads)


def _conv_layer(xp: Any, params: Any, x: Any, stride: int, padding: int) -> Any:
    bias = params.get("bias")
    return _conv2d(xp, x, params["weight"], bias, stride, (padding,) * 4)


def _pool2d(xp: Any, x: Any, size: int, reduction: Callable[..., Any]) -> Any:
    n, channels, height, width = x.shape
    windows = xp.reshape(x, (n, channels, height // size, size, width // size, size))
    return reduction(windows, axis=(3, 5))


def _standardize(xp: Any, x: Any, axes: tuple[int, ...], eps: float) -> Any:
    """Subtract the mean and divide by the (biased) standard deviation over ``axes``."""
    centred = x - xp.mean(x, axis=axes, keepdims=True)
    variance = xp.mean(centred * centred, axis=axes, keepdims=True)
    return centred / xp.sqrt(variance + eps)


def _softmax(xp: Any, x: Any) -> Any:
    # Shifting by the maximum changes nothing mathematically, so its derivative cancels.
    shifted = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
    return shifted / xp.sum(shifted, axis=-1, keepdims=True)


def _rnn_step(xp: Any, params: Any, x: Any, hidden: Any) -> Any:
    pre = _recurrent_preactivation(xp, params, x, hidden)
    return xp.tanh(pre[0] + pre[1])


def _recurrent_preactivation(xp: Any, params: Any, x: Any, hidden: Any) -> tuple[Any, Any]:
    """Input and hidden contributions; with no hidden state yet, the latter is its bias."""
    from_input = _add_bias(xp, xp.matmul(x, _transpose(xp, params["weight_ih"])), params["bias_ih"])
    if hidden is None:
        return from_input, _lift(xp, params["bias_hh"], from_input.ndim)
    return from_input, _add_bias(xp, xp.matmul(hidden, _transpose(xp, params["weight_hh"])), params["bias_hh"])


def _lstm_step(xp: Any, params: Any, x: Any, carry: Any) -> tuple[Any, Any]:
    hidden, cell = (None, None) if carry is None else carry
    from_input, from_hidden = _recurrent_preactivation(xp, params, x, hidden)
    gates = from_input + from_hidden
    size = gates.shape[-1] // 4
    input_gate = _sigmoid(xp, gates[..., :size])
    forget_gate = _sigmoid(xp, gates[..., size : 2 * size])
    candidate = xp.tanh(gates[..., 2 * size : 3 * size])
    output_gate = _sigmoid(xp, gates[..., 3 * size :])
    cell = input_gate * candidate if cell is None else forget_gate * cell + input_gate * candidate
    return output_gate * xp.tanh(cell), cell


def _gru_step(xp: Any, params: Any, x: Any, hidden: Any) -> Any:
    from_input, from_hidden = _recurrent_preactivation(xp, params, x, hidden)
    size = from_input.shape[-1] // 3
    reset = _sigmoid(xp, from_input[..., :size] + from_hidden[..., :size])
    update = _sigmoid(xp, from_input[..., size : 2 * size] + from_hidden[..., size : 2 * size])
    new = xp.tanh(from_input[..., 2 * size :] + reset * from_hidden[..., 2 * size :])
    if hidden is None:
        return (1 - update) * new
    return (1 - update) * new + update * hidden


def _unroll(xp: Any, cell: str, params: Any, sequence: Any) -> list[Any]:
    """Run ``cell`` over the leading (time) axis of ``sequence``, from a zero state."""
    carry = None
    hiddens = []
    for t in range(sequence.shape[0]):
        if cell == "rnn":
            carry = _rnn_step(xp, params, sequence[t], carry)
            hiddens.append(carry)
        elif cell == "lstm":
            carry = _lstm_step(xp, params, sequence[t], carry)
            hiddens.append(carry[0])
        elif cell == "gru":
            carry = _gru_step(xp, params, sequence[t], carry)
            hiddens.append(carry)
        else:
            raise ValueError(f"unknown cell {cell!r}; expected 'rnn', 'lstm' or 'gru'.")
    return hiddens


def _half_squared_error(xp: Any, output: Any, target: Any, like: Any) -> Any:
    residual = output - _float_array(xp, target, like)
    return xp.sum(residual * residual) / 2


# --------------------------------------------------------------------------------------------
# Forward passes: ``forward(xp, like, params, config, data, state) -> output``


def _dense(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Dense layer: ``activation(x W^T + b)``."""
    x = _float_array(xp, data["x"], like)
    return _activate(xp, _linear(xp, params, x), config["activation"])


def _dense_chain(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Dense layers in sequence, each with its own activation."""
    y = _float_array(xp, data["x"], like)
    for layer, activation in zip(config["layers"], config["activations"], strict=True):
        y = _activate(xp, _linear(xp, params[layer], y), activation)
    return y


def _scale(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Elementwise scale and shift, then an activation."""
    x = _float_array(xp, data["x"], like)
    y = _lift(xp, params["weight"], x.ndim) * x + _lift(xp, params["bias"], x.ndim)
    return _activate(xp, y, config["activation"])


def _conv(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """2-d convolution, NCHW input and OIHW weight."""
    x = _float_array(xp, data["x"], like)
    return _conv_layer(xp, params, x, config["stride"], config["padding"])


def _conv_chain(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Convolutions in sequence, each with its own activation, stride and padding."""
    y = _float_array(xp, data["x"], like)
    for layer, activation, stride, padding in zip(
        config["layers"], config["activations"], config["strides"], config["paddings"], strict=True
    ):
        y = _activate(xp, _conv_layer(xp, params[layer], y, stride, padding), activation)
    return y


def _conv_pool(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Convolution then non-overlapping pooling ('mean' or 'max')."""
    x = _float_array(xp, data["x"], like)
    y = _conv_layer(xp, params["conv"], x, 1, config["padding"])
    reduction = xp.mean if config["pool"] == "mean" else xp.max
    return _pool2d(xp, y, config["pool_size"], reduction)


def _maxout(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Maxout: the maximum over ``pieces`` affine maps per output unit."""
    x = _float_array(xp, data["x"], like)
    y = _linear(xp, params, x)
    pieces = config["pieces"]
    return xp.max(xp.reshape(y, (y.shape[0], y.shape[1] // pieces, pieces)), axis=2)


def _bilinear(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Bilinear layer: ``y_o = x1^T W_o x2 + b_o`` with ``W`` of shape (out, in1, in2)."""
    x1 = _float_array(xp, data["x1"], like)
    x2 = _float_array(xp, data["x2"], like)
    weight = params["weight"]
    outputs, in1, in2 = weight.shape
    folded = xp.reshape(xp.permute_dims(weight, (1, 0, 2)), (in1, outputs * in2))
    partial = xp.reshape(xp.matmul(x1, folded), (x1.shape[0], outputs, in2))
    return _add_bias(xp, xp.sum(partial * xp.reshape(x2, (x2.shape[0], 1, in2)), axis=2), params["bias"])


def _skip_concat(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Skip connection joined by concatenation: ``outer([x, tanh(inner(x))])``."""
    x = _float_array(xp, data["x"], like)
    inner = xp.tanh(_linear(xp, params["inner"], x))
    return _linear(xp, params["outer"], xp.concat([x, inner], axis=-1))


def _conv_transpose(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Transposed convolution, IOHW weight (torch's layout)."""
    x = _float_array(xp, data["x"], like)
    return _conv_transpose2d(
        xp,
        x,
        params["weight"],
        params["bias"],
        config["stride"],
        config["padding"],
        config["output_padding"],
    )


def _recurrent(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """A recurrent cell unrolled over the sequence; every hidden state is an output."""
    sequence = _float_array(xp, data["x"], like)
    return xp.stack(_unroll(xp, config["cell"], params["cell"], sequence), axis=0)


def _recurrent_dense(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """A recurrent cell unrolled over the sequence, its last hidden state read by a dense layer."""
    sequence = _float_array(xp, data["x"], like)
    last = _unroll(xp, config["cell"], params["cell"], sequence)[-1]
    return _linear(xp, params["readout"], last)


def _conv_group_norm(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Convolution then group normalisation with a per-channel affine map."""
    x = _float_array(xp, data["x"], like)
    y = _conv_layer(xp, params["conv"], x, 1, config["padding"])
    n, channels, height, width = y.shape
    groups = config["groups"]
    grouped = xp.reshape(y, (n, groups, channels // groups, height, width))
    y = xp.reshape(_standardize(xp, grouped, (2, 3, 4), config["eps"]), (n, channels, height, width))
    norm = params["norm"]
    return y * _channel_vector(xp, norm["weight"]) + _channel_vector(xp, norm["bias"])


def _dense_layer_norm(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Dense layer (no bias) then layer normalisation over the last axis."""
    x = _float_array(xp, data["x"], like)
    y = _standardize(xp, _linear(xp, params["dense"], x), (-1,), config["eps"])
    norm = params["norm"]
    return y * _lift(xp, norm["weight"], y.ndim) + _lift(xp, norm["bias"], y.ndim)


def _conv_instance_norm(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Convolution then instance normalisation (per sample and channel) with an affine map."""
    x = _float_array(xp, data["x"], like)
    y = _standardize(xp, _conv_layer(xp, params["conv"], x, 1, config["padding"]), (2, 3), config["eps"])
    norm = params["norm"]
    return y * _channel_vector(xp, norm["weight"]) + _channel_vector(xp, norm["bias"])


def _conv_batch_norm_eval(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Convolution then batch normalisation with the running statistics in ``state``."""
    x = _float_array(xp, data["x"], like)
    y = _conv_layer(xp, params["conv"], x, 1, config["padding"])
    mean = _channel_vector(xp, _float_array(xp, state["running_mean"], like))
    variance = _channel_vector(xp, _float_array(xp, state["running_var"], like))
    y = (y - mean) / xp.sqrt(variance + config["eps"])
    norm = params["norm"]
    return y * _channel_vector(xp, norm["weight"]) + _channel_vector(xp, norm["bias"])


def _attention(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Self-attention by scaled dot products, with torch ``MultiheadAttention``'s parameters."""
    x = _float_array(xp, data["x"], like)
    batch, length, embed = x.shape
    heads = config["heads"]
    head_dim = embed // heads
    projected = _add_bias(xp, xp.matmul(x, _transpose(xp, params["in_proj_weight"])), params["in_proj_bias"])

    def split_heads(part: Any) -> Any:
        return xp.permute_dims(xp.reshape(part, (batch, length, heads, head_dim)), (0, 2, 1, 3))

    query = split_heads(projected[:, :, :embed])
    key = split_heads(projected[:, :, embed : 2 * embed])
    value = split_heads(projected[:, :, 2 * embed :])
    scores = xp.matmul(query, xp.permute_dims(key, (0, 1, 3, 2))) * (1 / math.sqrt(head_dim))
    mixed = xp.matmul(_softmax(xp, scores), value)
    merged = xp.reshape(xp.permute_dims(mixed, (0, 2, 1, 3)), (batch, length, embed))
    return _linear(xp, params["out_proj"], merged)


def _embedding(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Embedding lookup of the integer ``data['indices']``."""
    indices = _index_array(xp, data["indices"], like)
    weight = params["weight"]
    rows = xp.take(weight, xp.reshape(indices, (-1,)), axis=0)
    return xp.reshape(rows, (*tuple(indices.shape), weight.shape[1]))


def _dense_dropout(xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any) -> Any:
    """Dense layer then dropout whose mask comes from ``numpy.random.default_rng(config['key'])``."""
    x = _float_array(xp, data["x"], like)
    y = _activate(xp, _linear(xp, params, x), config["activation"])
    rate = config["rate"]
    # the draws take x's array type before they meet the rate, which jit traces like any float context
    draws = _float_array(xp, numpy.random.default_rng(config["key"]).random(tuple(y.shape)), like)
    return y * xp.astype(draws >= rate, y.dtype) / (1 - rate)


# --------------------------------------------------------------------------------------------
# Losses


def _regression_loss(forward: Callable[..., Any], name: str) -> Loss:
    """Turn ``forward`` into ``loss(params, config, data, state)``: half the squared error
    between the output and ``data['target']``, so every parameter reaches the loss."""

    def loss(params: Any, config: dict[str, Any], data: dict[str, Any], state: Any = None) -> Any:
        xp, like = _namespace_and_like(params)
        output = forward(xp, like, params, config, data, state)
        return _half_squared_error(xp, output, data["target"], like)

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = f"{forward.__doc__}\n\nLoss: half the squared error against ``data['target']``."
    loss.forward = forward  # type: ignore[attr-defined]
    return loss


dense_loss = _regression_loss(_dense, "dense_loss")
dense_chain_loss = _regression_loss(_dense_chain, "dense_chain_loss")
scale_loss = _regression_loss(_scale, "scale_loss")
conv_loss = _regression_loss(_conv, "conv_loss")
conv_chain_loss = _regression_loss(_conv_chain, "conv_chain_loss")
conv_pool_loss = _regression_loss(_conv_pool, "conv_pool_loss")
maxout_loss = _regression_loss(_maxout, "maxout_loss")
bilinear_loss = _regression_loss(_bilinear, "bilinear_loss")
skip_concat_loss = _regression_loss(_skip_concat, "skip_concat_loss")
conv_transpose_loss = _regression_loss(_conv_transpose, "conv_transpose_loss")
recurrent_loss = _regression_loss(_recurrent, "recurrent_loss")
recurrent_dense_loss = _regression_loss(_recurrent_dense, "recurrent_dense_loss")
group_norm_loss = _regression_loss(_conv_group_norm, "group_norm_loss")
layer_norm_loss = _regression_loss(_dense_layer_norm, "layer_norm_loss")
instance_norm_loss = _regression_loss(_conv_instance_norm, "instance_norm_loss")
batch_norm_eval_loss = _regression_loss(_conv_batch_norm_eval, "batch_norm_eval_loss")
attention_loss = _regression_loss(_attention, "attention_loss")
embedding_loss = _regression_loss(_embedding, "embedding_loss")
dropout_loss = _regression_loss(_dense_dropout, "dropout_loss")


def _conv_batch_norm_train(
    xp: Any, like: Any, params: Any, config: Any, data: Any, state: Any
) -> tuple[Any, dict[str, Any]]:
    """Convolution then batch normalisation in training mode: ``(output, new_state)``.

    Normalises with the batch statistics; the new running mean and variance are updated as
    torch does (momentum, unbiased batch variance), computed without touching ``state``.
    """
    x = _float_array(xp, data["x"], like)
    y = _conv_layer(xp, params["conv"], x, 1, config["padding"])
    n, channels, height, width = y.shape
    axes = (0, 2, 3)
    mean = xp.mean(y, axis=axes, keepdims=True)
    centred = y - mean
    variance = xp.mean(centred * centred, axis=axes, keepdims=True)
    normalised = centred / xp.sqrt(variance + config["eps"])
    norm = params["norm"]
    output = normalised * _channel_vector(xp, norm["weight"]) + _channel_vector(xp, norm["bias"])
    count = n * height * width
    momentum = config["momentum"]
    new_state = {
        "running_mean": (1 - momentum) * _float_array(xp, state["running_mean"], like)
        + momentum * xp.reshape(mean, (channels,)),
        "running_var": (1 - momentum) * _float_array(xp, state["running_var"], like)
        + momentum * xp.reshape(variance, (channels,)) * (count / (count - 1)),
    }
    return output, new_state


def batch_norm_train_loss(
    params: Any, config: dict[str, Any], data: dict[str, Any], state: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """Convolution then batch normalisation in training mode.

    Returns ``(loss, new_state)``: half the squared error against ``data['target']``, and the
    running statistics updated functionally (``state`` itself is left unchanged).
    """
    xp, like = _namespace_and_like(params)
    output, new_state = _conv_batch_norm_train(xp, like, params, config, data, state)
    return _half_squared_error(xp, output, data["target"], like), new_state


batch_norm_train_loss.forward = _conv_batch_norm_train  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One layer of the zoo, with everything needed to evaluate and differentiate it.

    ``loss(params, config, data, state)`` returns a 0-d array, or ``(loss, new_state)`` when
    ``has_aux``. ``params`` is the point to differentiate at (nested dicts of numpy arrays);
    ``config`` holds plain Python values; ``data`` and ``state`` are constants.
    """

    name: str
    loss: Loss
    params: dict[str, Any]
    config: dict[str, Any]
    data: dict[str, Any]
    state: dict[str, Any] | None = None
    has_aux: bool = False
    tags: frozenset[str] = frozenset()
    note: str = ""

    @property
    def param_count(self) -> int:
        """The number of scalar parameters."""
        return sum(int(numpy.size(leaf)) for leaf in _leaves(self.params))


def _cast(tree: Any, dtype: Any) -> Any:
    """Floating leaves of ``tree`` (nested dicts) cast to ``dtype``; others unchanged."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {key: _cast(value, dtype) for key, value in tree.items()}
    array = numpy.asarray(tree)
    return array.astype(dtype) if numpy.issubdtype(array.dtype, numpy.floating) else array


class _Builder:
    """Draws parameters and data from one generator, always in float64 before casting, so that
    the float32 zoo is the float64 zoo rounded."""

    def __init__(self, dtype: Any, seed: int) -> None:
        self.dtype = numpy.dtype(dtype)
        self.rng = numpy.random.default_rng(seed)

    def normal(self, *shape: int, scale: float = 1.0) -> numpy.ndarray:
        return scale * self.rng.standard_normal(shape)

    def linear(self, out_features: int, in_features: int, bias: bool = True) -> dict[str, Any]:
        params = {"weight": self.normal(out_features, in_features, scale=in_features**-0.5)}
        if bias:
            params["bias"] = self.normal(out_features, scale=0.5)
        return params

    def conv(self, out_channels: int, in_channels: int, kernel: int, bias: bool = True) -> dict[str, Any]:
        fan_in = in_channels * kernel * kernel
        params = {"weight": self.normal(out_channels, in_channels, kernel, kernel, scale=fan_in**-0.5)}
        if bias:
            params["bias"] = self.normal(out_channels, scale=0.5)
        return params

    def affine(self, features: int) -> dict[str, Any]:
        return {"weight": 1 + self.normal(features, scale=0.3), "bias": self.normal(features, scale=0.3)}

    def recurrent_cell(self, gates: int, inputs: int, hidden: int) -> dict[str, Any]:
        return {
            "weight_ih": self.normal(gates * hidden, inputs, scale=inputs**-0.5),
            "weight_hh": self.normal(gates * hidden, hidden, scale=hidden**-0.5),
            "bias_ih": self.normal(gates * hidden, scale=0.3),
            "bias_hh": self.normal(gates * hidden, scale=0.3),
        }

    def case(
        self,
        name: str,
        loss: Loss,
        params: dict[str, Any],
        config: dict[str, Any],
        data: dict[str, Any],
        state: dict[str, Any] | None = None,
        *,
        tags: set[str],
        note: str,
        has_aux: bool = False,
    ) -> LayerCase:
        params, data, state = _cast(params, self.dtype), _cast(data, self.dtype), _cast(state, self.dtype)
        output = self._output(loss, params, config, data, state, has_aux)
        data = {**data, "target": self.normal(*output.shape).astype(self.dtype)}
        return LayerCase(name, loss, params, config, data, state, has_aux, frozenset(tags), note)

    @staticmethod
    def _output(loss: Loss, params: Any, config: Any, data: Any, state: Any, has_aux: bool) -> numpy.ndarray:
        # The target has the output's shape, which the forward pass itself tells.
        xp, like = _namespace_and_like(params)
        output = loss.forward(xp, like, params, config, data, state)  # type: ignore[attr-defined]
        return numpy.asarray(output[0] if has_aux else output)


def layer_cases(dtype: Any = numpy.float64, seed: int = 0) -> list[LayerCase]:
    """The layer zoo, small enough to differentiate by finite differences in seconds.

    Parameters
    ----------
    dtype
        Floating dtype of the parameters and the floating data (integer data stay integer).
    seed
        Seed of the ``numpy.random.default_rng`` that draws every value.

    Returns
    -------
    list of LayerCase
        Fresh arrays on every call, so a case may be mutated by a test without affecting others.
    """
    b = _Builder(dtype, seed)
    smooth_dense = "smooth; finite differences in float64 are the ground truth"
    cases = [
        b.case(
            "dense",
            dense_loss,
            b.linear(3, 5),
            {"activation": "identity"},
            {"x": b.normal(4, 5)},
            tags={"dense"},
            note="affine map: the simplest case, " + smooth_dense,
        ),
        b.case(
            "dense_nobias",
            dense_loss,
            b.linear(3, 5, bias=False),
            {"activation": "tanh"},
            {"x": b.normal(4, 5)},
            tags={"dense"},
            note="no bias leaf: the params tree differs in structure from 'dense'",
        ),
        b.case(
            "dense_tanh",
            dense_loss,
            b.linear(3, 5),
            {"activation": "tanh"},
            {"x": b.normal(4, 5)},
            tags={"dense"},
            note="nonlinear activation, " + smooth_dense,
        ),
        b.case(
            "dense_chain",
            dense_chain_loss,
            {"dense1": b.linear(6, 5), "dense2": b.linear(4, 6), "dense3": b.linear(2, 4)},
            {
                "layers": ("dense1", "dense2", "dense3"),
                "activations": ("tanh", "sigmoid", "identity"),
            },
            {"x": b.normal(4, 5)},
            tags={"dense", "chain"},
            note="nested params: a dict of layers, each a dict of arrays",
        ),
        b.case(
            "scale",
            scale_loss,
            {"weight": 1 + b.normal(3, 5, scale=0.3), "bias": b.normal(3, 5, scale=0.3)},
            {"activation": "tanh"},
            {"x": b.normal(4, 3, 5)},
            tags={"elementwise"},
            note="parameters broadcast against a batch axis",
        ),
        b.case(
            "conv",
            conv_loss,
            b.conv(3, 2, 3),
            {"stride": 1, "padding": 0},
            {"x": b.normal(2, 2, 6, 6)},
            tags={"conv"},
            note="convolution by im2col (strided slices, stack, matmul), no padding",
        ),
        b.case(
            "conv_pad1",
            conv_loss,
            b.conv(3, 2, 3),
            {"stride": 1, "padding": 1},
            {"x": b.normal(2, 2, 5, 5)},
            tags={"conv"},
            note="zero padding built by concatenation (the array API has no pad)",
        ),
        b.case(
            "conv_stride2",
            conv_loss,
            b.conv(3, 2, 3),
            {"stride": 2, "padding": 1},
            {"x": b.normal(2, 2, 7, 7)},
            tags={"conv"},
            note="strided convolution: slices with step 2",
        ),
        b.case(
            "conv_chain",
            conv_chain_loss,
            {"conv1": b.conv(3, 2, 3), "conv2": b.conv(2, 3, 3)},
            {
                "layers": ("conv1", "conv2"),
                "activations": ("tanh", "identity"),
                "strides": (1, 1),
                "paddings": (1, 0),
            },
            {"x": b.normal(2, 2, 5, 5)},
            tags={"conv", "chain"},
            note="two convolutions with an activation between them",
        ),
        b.case(
            "conv_meanpool",
            conv_pool_loss,
            {"conv": b.conv(3, 2, 3)},
            {"padding": 1, "pool": "mean", "pool_size": 2},
            {"x": b.normal(2, 2, 6, 6)},
            tags={"conv", "pooling"},
            note="mean pooling by reshape and mean",
        ),
        b.case(
            "conv_maxpool",
            conv_pool_loss,
            {"conv": b.conv(3, 2, 3)},
            {"padding": 1, "pool": "max", "pool_size": 2},
            {"x": b.normal(2, 2, 6, 6)},
            tags={"conv", "pooling", "piecewise"},
            note="max pooling is piecewise: continuous random data make ties (and kinks within a "
            "finite-difference step) improbable; seed 0 has none",
        ),
        b.case(
            "maxout",
            maxout_loss,
            b.linear(6, 5),
            {"pieces": 2},
            {"x": b.normal(10, 5)},
            tags={"dense", "piecewise"},
            note="maximum over pieces is piecewise; ten samples so every piece wins somewhere and "
            "every parameter has a gradient",
        ),
        b.case(
            "bilinear",
            bilinear_loss,
            {"weight": b.normal(2, 3, 4, scale=0.5), "bias": b.normal(2, scale=0.5)},
            {},
            {"x1": b.normal(4, 3), "x2": b.normal(4, 4)},
            tags={"dense"},
            note="two inputs and a rank-3 weight",
        ),
        b.case(
            "skip_concat",
            skip_concat_loss,
            {"inner": b.linear(4, 3), "outer": b.linear(2, 7)},
            {},
            {"x": b.normal(4, 3)},
            tags={"dense", "skip"},
            note="skip connection joined by concatenation: the input reaches the output twice",
        ),
        b.case(
            "conv_transpose",
            conv_transpose_loss,
            {"weight": b.normal(3, 2, 3, 3, scale=1 / 3), "bias": b.normal(2, scale=0.5)},
            {"stride": 2, "padding": 1, "output_padding": 1},
            {"x": b.normal(2, 3, 3, 3)},
            tags={"conv"},
            note="transposed convolution, stride 2: zero insertion, flipped kernel, asymmetric padding",
        ),
        b.case(
            "rnn",
            recurrent_loss,
            {"cell": b.recurrent_cell(1, 3, 4)},
            {"cell": "rnn"},
            {"x": b.normal(4, 3, 3)},
            tags={"recurrent"},
            note="tanh RNN cell unrolled over 4 steps: a Python loop the engines trace through",
        ),
        b.case(
            "lstm",
            recurrent_loss,
            {"cell": b.recurrent_cell(4, 3, 4)},
            {"cell": "lstm"},
            {"x": b.normal(4, 3, 3)},
            tags={"recurrent"},
            note="LSTM cell unrolled: a carried (hidden, cell) pair",
        ),
        b.case(
            "gru",
            recurrent_loss,
            {"cell": b.recurrent_cell(3, 3, 4)},
            {"cell": "gru"},
            {"x": b.normal(4, 3, 3)},
            tags={"recurrent"},
            note="GRU cell unrolled: the reset gate multiplies the hidden contribution",
        ),
        b.case(
            "lstm_dense",
            recurrent_dense_loss,
            {"cell": b.recurrent_cell(4, 3, 4), "readout": b.linear(2, 4)},
            {"cell": "lstm"},
            {"x": b.normal(4, 3, 3)},
            tags={"recurrent", "chain"},
            note="recurrent model chained into a dense layer on the last hidden state",
        ),
        b.case(
            "group_norm",
            group_norm_loss,
            {"conv": b.conv(4, 2, 3), "norm": b.affine(4)},
            {"padding": 1, "groups": 2, "eps": 1e-5},
            {"x": b.normal(2, 2, 4, 4)},
            tags={"conv", "normalization"},
            note="normalisation: in float32 finite differences are too noisy, compare two AD paths",
        ),
        b.case(
            "layer_norm",
            layer_norm_loss,
            {"dense": b.linear(6, 5, bias=False), "norm": b.affine(6)},
            {"eps": 1e-5},
            {"x": b.normal(3, 4, 5)},
            tags={"dense", "normalization"},
            note="normalisation: in float32 finite differences are too noisy, compare two AD paths",
        ),
        b.case(
            "instance_norm",
            instance_norm_loss,
            {"conv": b.conv(3, 2, 3, bias=False), "norm": b.affine(3)},
            {"padding": 1, "eps": 1e-5},
            {"x": b.normal(2, 2, 4, 4)},
            tags={"conv", "normalization"},
            note="per-sample statistics; the convolution has no bias because the normalisation "
            "would cancel it (its gradient would be zero)",
        ),
        b.case(
            "batch_norm_train",
            batch_norm_train_loss,
            {"conv": b.conv(3, 2, 3, bias=False), "norm": b.affine(3)},
            {"padding": 1, "eps": 1e-5, "momentum": 0.1},
            {"x": b.normal(3, 2, 4, 4)},
            {"running_mean": b.normal(3, scale=0.1), "running_var": 1 + b.rng.random(3)},
            tags={"conv", "normalization", "state"},
            has_aux=True,
            note="training mode returns (loss, new_state) with the running statistics updated "
            "functionally; the given state must stay unchanged",
        ),
        b.case(
            "batch_norm_eval",
            batch_norm_eval_loss,
            {"conv": b.conv(3, 2, 3, bias=False), "norm": b.affine(3)},
            {"padding": 1, "eps": 1e-5},
            {"x": b.normal(3, 2, 4, 4)},
            {"running_mean": b.normal(3, scale=0.1), "running_var": 1 + b.rng.random(3)},
            tags={"conv", "normalization", "state"},
            note="evaluation mode: the running statistics are a constant state",
        ),
        b.case(
            "attention",
            attention_loss,
            {
                "in_proj_weight": b.normal(12, 4, scale=0.5),
                "in_proj_bias": b.normal(12, scale=0.3),
                "out_proj": b.linear(4, 4),
            },
            {"heads": 1},
            {"x": b.normal(2, 5, 4)},
            tags={"attention"},
            note="softmax of scaled dot products; the key bias shifts every score of a row "
            "equally, so its gradient is exactly zero",
        ),
        b.case(
            "multihead_attention",
            attention_loss,
            {
                "in_proj_weight": b.normal(12, 4, scale=0.5),
                "in_proj_bias": b.normal(12, scale=0.3),
                "out_proj": b.linear(4, 4),
            },
            {"heads": 2},
            {"x": b.normal(2, 5, 4)},
            tags={"attention"},
            note="two heads: reshape and permute between projections; the key bias has zero gradient",
        ),
        b.case(
            "embedding",
            embedding_loss,
            {"weight": b.normal(6, 3)},
            {},
            {"indices": b.rng.permutation(numpy.concatenate([numpy.arange(6), b.rng.integers(0, 6, 6)])).reshape(3, 4)},
            tags={"embedding"},
            note="integer indices are a constant; every row is used and some twice, so gradients accumulate",
        ),
        b.case(
            "dropout",
            dropout_loss,
            b.linear(4, 5),
            {"activation": "tanh", "rate": 0.3, "key": 1234},
            {"x": b.normal(8, 5)},
            tags={"dense", "random"},
            note="the mask comes from numpy.random.default_rng(config['key']), so two calls agree; "
            "a global-RNG dropout would not",
        ),
    ]
    return cases
