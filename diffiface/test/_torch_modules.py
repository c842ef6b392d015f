"""The layer zoo as ``torch.nn`` modules, called through ``torch.func.functional_call``.

Every case here has a twin in :mod:`diffiface.test._layers` with the same name, the same
parameter values, the same data and the same loss, so the two can be checked against each other.
Parameter names are
the zoo's nested names joined by dots; a single dense layer sits in a ``Sequential`` beside its
activation, so its names gain the prefix ``dense.``.

torch is imported on first use, never when this module is imported.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy

from ._layers import LayerCase, layer_cases

__all__ = ["TorchModuleCase", "torch_module_cases"]


@dataclasses.dataclass(frozen=True)
class TorchModuleCase:
    """A ``torch.nn.Module`` with the point to differentiate at and its loss.

    ``loss(params, module, data)`` takes ``params`` as a dict of torch tensors named as in
    ``module.named_parameters()``, calls the module through ``torch.func.functional_call`` and
    returns a 0-d tensor. ``data`` leaves may be numpy arrays or torch tensors.
    """

    name: str
    module: Any
    params: dict[str, numpy.ndarray]
    data: dict[str, Any]
    loss: Callable[..., Any]
    tags: frozenset[str] = frozenset()
    note: str = ""
    #: The name of the zoo case computing the same loss at the same point, if any.
    twin: str | None = None
    #: Whether ``loss`` returns ``(value, aux)``: the new state of a stateful layer, returned
    #: instead of written into the module (differentiate with ``has_aux=True``).
    has_aux: bool = False

    @property
    def param_count(self) -> int:
        """The number of scalar parameters."""
        return sum(int(value.size) for value in self.params.values())


def module_loss(
    params: dict[str, Any],
    module: Any,
    data: dict[str, Any],
    *,
    inputs: tuple[str, ...] = ("x",),
    keywords: dict[str, Any] | None = None,
    first_output: bool = False,
) -> Any:
    """Half the squared error between ``module``'s output and ``data['target']``.

    The module is called as ``functional_call(module, params, args, keywords)`` with
    ``args = tuple(data[name] for name in inputs)``; ``first_output`` takes element 0 of a tuple
    output (as ``MultiheadAttention`` returns).
    """
    import torch

    like = next(iter(params.values()))

    def tensor(value: Any) -> Any:
        result = torch.as_tensor(value, device=like.device)
        return result.to(like.dtype) if result.is_floating_point() else result

    args = tuple(tensor(data[name]) for name in inputs)
    output = torch.func.functional_call(module, params, args, keywords or {})
    if first_output:
        output = output[0]
    residual = output - tensor(data["target"])
    return torch.sum(residual * residual) / 2


def batch_norm_train_loss(params: dict[str, Any], module: Any, data: dict[str, Any]) -> tuple[Any, Any]:
    """:func:`module_loss` of a module in train mode, its buffers cloned inside the loss: the
    BatchNorm updates the clones, returned as the aux, and the module is left as it was."""
    import torch

    buffers = {name: buffer.clone() for name, buffer in module.named_buffers()}
    like = next(iter(params.values()))
    inputs = torch.as_tensor(data["x"], device=like.device).to(like.dtype)
    output = torch.func.functional_call(module, (params, buffers), (inputs,))
    residual = output - torch.as_tensor(data["target"], device=like.device).to(like.dtype)
    return torch.sum(residual * residual) / 2, {name: buffer.detach() for name, buffer in buffers.items()}


def generator_dropout_loss(params: dict[str, Any], module: Any, data: dict[str, Any]) -> Any:
    """:func:`module_loss` of a dense layer and a dropout whose mask comes from the generator
    ``data['generator']``: a copy of it is drawn from, so that every call (and every point a
    finite difference evaluates) sees the same mask and the caller's generator does not advance."""
    import torch

    source = data["generator"]
    generator = torch.Generator(device=source.device)
    generator.set_state(source.get_state())
    like = next(iter(params.values()))
    inputs = torch.as_tensor(data["x"], device=like.device).to(like.dtype)
    output = torch.func.functional_call(module, params, (inputs,), {"generator": generator})
    residual = output - torch.as_tensor(data["target"], device=like.device).to(like.dtype)
    return torch.sum(residual * residual) / 2


@functools.lru_cache(maxsize=1)
def _generator_dropout_type() -> type:
    import torch

    class GeneratorDropout(torch.nn.Module):
        """A dense layer, then dropout with rate ``p`` drawn from the generator passed to
        ``forward`` (``torch.nn.Dropout`` draws from the global generator, which makes a loss
        change between two calls at the same point)."""

        def __init__(self, features_in: int, features_out: int, p: float) -> None:
            super().__init__()
            self.dense = torch.nn.Linear(features_in, features_out)
            self.p = p

        def forward(self, inputs: Any, generator: Any) -> Any:
            hidden = torch.tanh(self.dense(inputs))
            keep = torch.rand(hidden.shape, generator=generator, device=hidden.device) >= self.p
            return torch.where(keep, hidden / (1 - self.p), torch.zeros_like(hidden))

    return GeneratorDropout


def _functional_cases(torch: Any, torch_dtype: Any, dtype: Any, seed: int) -> list[TorchModuleCase]:
    """The recipes of stateful and random modules: a train-mode BatchNorm through ``has_aux``,
    and a dropout driven by an explicit generator."""
    cases = []
    for zoo_case in layer_cases(dtype, seed):
        if zoo_case.name != "batch_norm_train":
            continue
        module = _modules(torch)["batch_norm_train"](zoo_case).to(torch_dtype)
        values = _zoo_to_module_names(zoo_case)
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                parameter.copy_(torch.as_tensor(values[name]))
        module.train()
        cases.append(
            TorchModuleCase(
                name="batch_norm_train_aux",
                module=module,
                params={name: numpy.array(value) for name, value in values.items()},
                data={"x": zoo_case.data["x"], "target": zoo_case.data["target"]},
                loss=batch_norm_train_loss,
                tags=frozenset({"stateful", "normalization"}),
                note="train-mode BatchNorm2d on cloned buffers: the new running statistics come back as the aux",
                has_aux=True,
            )
        )
    rng = numpy.random.default_rng(seed)
    module = _generator_dropout_type()(4, 3, 0.5).to(torch_dtype)
    params = {name: rng.standard_normal(tuple(p.shape)).astype(dtype) for name, p in module.named_parameters()}
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(torch.as_tensor(params[name]))
    cases.append(
        TorchModuleCase(
            name="dropout_generator",
            module=module,
            params=params,
            data={
                "x": rng.standard_normal((5, 4)).astype(dtype),
                "target": rng.standard_normal((5, 3)).astype(dtype),
                "generator": torch.Generator().manual_seed(seed),
            },
            loss=generator_dropout_loss,
            tags=frozenset({"random"}),
            note="dropout whose mask comes from a copy of an explicit torch.Generator passed in the data",
        )
    )
    return cases


@functools.lru_cache(maxsize=1)
def _unrolled_type() -> type:
    import torch

    class Unrolled(torch.nn.Module):
        """A recurrent cell run over the leading axis from a zero state; returns every hidden
        state stacked, or the readout of the last one."""

        def __init__(self, cell: Any, readout: Any = None) -> None:
            super().__init__()
            self.cell = cell
            if readout is not None:
                self.readout = readout

        def forward(self, sequence: Any) -> Any:
            carry = None
            hiddens = []
            for step in torch.unbind(sequence, 0):
                carry = self.cell(step, carry)
                hiddens.append(carry[0] if isinstance(carry, tuple) else carry)
            if hasattr(self, "readout"):
                return self.readout(hiddens[-1])
            return torch.stack(hiddens)

    return Unrolled


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _modules(torch: Any) -> dict[str, Callable[[LayerCase], Any]]:
    """For each zoo case with a torch twin, how to build the module from the case's config."""
    nn = torch.nn
    unrolled = _unrolled_type()

    def sequential(**layers: Any) -> Any:
        return nn.Sequential(OrderedDict(layers))

    def conv_like(params: dict[str, Any], padding: int, stride: int = 1) -> Any:
        out_channels, in_channels, kernel, _ = params["weight"].shape
        return nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding, bias="bias" in params)

    def linear_like(params: dict[str, Any]) -> Any:
        out_features, in_features = params["weight"].shape
        return nn.Linear(in_features, out_features, bias="bias" in params)

    activations = {"identity": nn.Identity, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}

    def dense(case: LayerCase) -> Any:
        return sequential(dense=linear_like(case.params), act=activations[case.config["activation"]]())

    def dense_chain(case: LayerCase) -> Any:
        layers: dict[str, Any] = {}
        for index, (name, activation) in enumerate(zip(case.config["layers"], case.config["activations"], strict=True)):
            layers[name] = linear_like(case.params[name])
            layers[f"act{index + 1}"] = activations[activation]()
        return sequential(**layers)

    def conv_case(case: LayerCase) -> Any:
        return conv_like(case.params, case.config["padding"], case.config["stride"])

    def conv_chain(case: LayerCase) -> Any:
        layers: dict[str, Any] = {}
        config = case.config
        for index, (name, activation, stride, padding) in enumerate(
            zip(config["layers"], config["activations"], config["strides"], config["paddings"], strict=True)
        ):
            layers[name] = conv_like(case.params[name], padding, stride)
            layers[f"act{index + 1}"] = activations[activation]()
        return sequential(**layers)

    def conv_pool(case: LayerCase) -> Any:
        pool = nn.AvgPool2d if case.config["pool"] == "mean" else nn.MaxPool2d
        return sequential(
            conv=conv_like(case.params["conv"], case.config["padding"]), pool=pool(case.config["pool_size"])
        )

    def bilinear(case: LayerCase) -> Any:
        out_features, in1, in2 = case.params["weight"].shape
        return nn.Bilinear(in1, in2, out_features)

    def conv_transpose(case: LayerCase) -> Any:
        in_channels, out_channels, kernel, _ = case.params["weight"].shape
        config = case.config
        return nn.ConvTranspose2d(
            in_channels,
            out_channels,
            kernel,
            stride=config["stride"],
            padding=config["padding"],
            output_padding=config["output_padding"],
        )

    def recurrent(case: LayerCase) -> Any:
        cell_params = case.params["cell"]
        hidden, inputs = cell_params["weight_hh"].shape[1], cell_params["weight_ih"].shape[1]
        cell_type = {"rnn": nn.RNNCell, "lstm": nn.LSTMCell, "gru": nn.GRUCell}[case.config["cell"]]
        readout = linear_like(case.params["readout"]) if "readout" in case.params else None
        return unrolled(cell_type(inputs, hidden), readout)

    def group_norm(case: LayerCase) -> Any:
        channels = case.params["norm"]["weight"].shape[0]
        norm = nn.GroupNorm(case.config["groups"], channels, eps=case.config["eps"])
        return sequential(conv=conv_like(case.params["conv"], case.config["padding"]), norm=norm)

    def layer_norm(case: LayerCase) -> Any:
        features = case.params["norm"]["weight"].shape[0]
        norm = nn.LayerNorm(features, eps=case.config["eps"])
        return sequential(dense=linear_like(case.params["dense"]), norm=norm)

    def instance_norm(case: LayerCase) -> Any:
        channels = case.params["norm"]["weight"].shape[0]
        norm = nn.InstanceNorm2d(channels, eps=case.config["eps"], affine=True)
        return sequential(conv=conv_like(case.params["conv"], case.config["padding"]), norm=norm)

    def batch_norm(case: LayerCase) -> Any:
        channels = case.params["norm"]["weight"].shape[0]
        momentum = case.config.get("momentum", 0.1)
        norm = nn.BatchNorm2d(channels, eps=case.config["eps"], momentum=momentum)
        return sequential(conv=conv_like(case.params["conv"], case.config["padding"]), norm=norm)

    def attention(case: LayerCase) -> Any:
        embed = case.params["in_proj_weight"].shape[1]
        return nn.MultiheadAttention(embed, case.config["heads"], batch_first=True)

    def embedding(case: LayerCase) -> Any:
        return nn.Embedding(*case.params["weight"].shape)

    return {
        "dense": dense,
        "dense_nobias": dense,
        "dense_tanh": dense,
        "dense_chain": dense_chain,
        "conv": conv_case,
        "conv_pad1": conv_case,
        "conv_stride2": conv_case,
        "conv_chain": conv_chain,
        "conv_meanpool": conv_pool,
        "conv_maxpool": conv_pool,
        "bilinear": bilinear,
        "conv_transpose": conv_transpose,
        "rnn": recurrent,
        "lstm": recurrent,
        "gru": recurrent,
        "lstm_dense": recurrent,
        "group_norm": group_norm,
        "layer_norm": layer_norm,
        "instance_norm": instance_norm,
        "batch_norm_train": batch_norm,
        "batch_norm_eval": batch_norm,
        "attention": attention,
        "multihead_attention": attention,
        "embedding": embedding,
    }


def _zoo_to_module_names(case: LayerCase) -> dict[str, numpy.ndarray]:
    flat = _flatten(case.params)
    if case.name.startswith("dense") and case.name != "dense_chain":
        # The single dense layer sits inside a Sequential next to its activation.
        return {f"dense.{key}": value for key, value in flat.items()}
    return flat


_LOSS_KEYWORDS: dict[str, dict[str, Any]] = {
    "bilinear": {"inputs": ("x1", "x2")},
    "attention": {"inputs": ("x", "x", "x"), "keywords": {"need_weights": False}, "first_output": True},
    "embedding": {"inputs": ("indices",)},
}
_LOSS_KEYWORDS["multihead_attention"] = _LOSS_KEYWORDS["attention"]


def torch_module_cases(dtype: Any = numpy.float64, seed: int = 0) -> list[TorchModuleCase]:
    """The torch twins of the layer zoo, with the zoo's parameter values and data.

    Parameters
    ----------
    dtype
        Floating dtype of the modules, their parameters and the floating data.
    seed
        Seed passed to :func:`~diffiface.test._layers.layer_cases`.

    Returns
    -------
    list of TorchModuleCase
        Fresh modules on every call. All are in eval mode except ``batch_norm_train``, whose
        module updates its running-statistics buffers in place on every call (tag
        ``"mutates_state"``), and ``batch_norm_train_aux``, the same module in train mode
        whose loss clones the buffers and returns their new values (``has_aux``). Last comes
        ``dropout_generator``, a dropout driven by an explicit ``torch.Generator``.
    """
    import torch

    torch_dtype = getattr(torch, numpy.dtype(dtype).name)
    builders = _modules(torch)
    cases = []
    for zoo_case in layer_cases(dtype, seed):
        build = builders.get(zoo_case.name)
        if build is None:
            continue
        module = build(zoo_case).to(torch_dtype)
        values = _zoo_to_module_names(zoo_case)
        parameters = dict(module.named_parameters())
        if set(parameters) != set(values):
            raise AssertionError(
                f"{zoo_case.name}: module parameters {sorted(parameters)} differ from the zoo's {sorted(values)}"
            )
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(torch.as_tensor(values[name]))
            if zoo_case.state is not None:
                norm = module.norm
                norm.running_mean.copy_(torch.as_tensor(zoo_case.state["running_mean"]))
                norm.running_var.copy_(torch.as_tensor(zoo_case.state["running_var"]))
        tags = set(zoo_case.tags)
        note = zoo_case.note
        if zoo_case.has_aux:
            module.train()
            tags.add("mutates_state")
            note = (
                "train-mode BatchNorm2d updates its running-statistics buffers in place on every "
                "call: the deliberate case of a function that mutates its state"
            )
        else:
            module.eval()
        cases.append(
            TorchModuleCase(
                name=zoo_case.name,
                module=module,
                params={name: numpy.array(value) for name, value in values.items()},
                data=dict(zoo_case.data),
                loss=functools.partial(module_loss, **_LOSS_KEYWORDS.get(zoo_case.name, {})),
                tags=frozenset(tags),
                note=note,
                twin=zoo_case.name,
            )
        )
    return cases + _functional_cases(torch, torch_dtype, dtype, seed)
