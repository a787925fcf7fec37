"""Parameters built on the meta device, given their storage by the ZeRO optimizer (DeepSpeed's ``zero.Init``).

A model built in fp32 on the device and then handed to the optimizer holds, at construction, the
fp32 model beside the flat 16-bit buffer (stage 3: the partition) and the fp32 master shard it is
copied into -- more than a 16-bit step itself needs. Built on ``meta`` in the working dtype, a
parameter is only a shape until the optimizer binds it to its place in the flat buffer; its
initial values are drawn by ``master_init(name, out)`` into an fp32 temporary of one parameter
(``ParamDraws``), and the master and the 16-bit parameter are both taken from it: the values a
model built in fp32 gives, rounded the same way, without the fp32 model.

A meta parameter cannot be rebound in place: ``p.data = t`` refuses to turn a meta tensor into a
device one, and ``torch.utils.swap_tensors`` refuses tensors a ``FakeTensorMode`` keeps weak
references to (the dry run). So ``bind_params`` *replaces* it, in every module holding it, by a
new ``nn.Parameter`` carrying the old one's attributes (its ``ShardInfo``); a parameter already
on a device is rebound in place as before. Take ``model.parameters()`` after building the optimizer.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

MasterInit = Callable[[str, torch.Tensor], None]
"""``master_init(name, out)``: write parameter ``name``'s initial values into ``out`` (contiguous, of
its shape, in the master dtype); the same values on every DP rank (e.g. ``GPT.init_parameter_``)."""


def on_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` is a shape without data (``device.type``: a dry run's fake tensors are all ``is_meta``)."""
    return t.device.type == "meta"


def check_meta(model: nn.Module, master_init: MasterInit | None) -> None:
    """Refuse what the optimizer cannot give values to: meta parameters without ``master_init``,
    meta buffers, meta parameters that are not floating point (no master to draw them as)."""
    params = [n for n, p in model.named_parameters() if on_meta(p)]
    if params and master_init is None:
        raise ValueError(f"ZeroOptimizer: parameter(s) {params[:3]} are on the meta device and have no values; "
                         f"pass master_init (e.g. GPT.init_parameter_) or build the model on a device")
    left = [n for n, b in model.named_buffers() if on_meta(b)]
    left += [n for n, p in model.named_parameters() if on_meta(p) and not p.is_floating_point()]
    if left:
        raise ValueError(f"ZeroOptimizer: {left[:3]} on the meta device cannot be drawn by master_init; "
                         f"materialise buffers and integer parameters before building the optimizer")


class ParamDraws:
    """One parameter's initial values at a time, flat, in the master dtype.

    A chunk's pieces are read parameter by parameter and a parameter's pieces follow each other in
    the layout, so holding the last parameter drawn is enough: one temporary of one parameter.
    """

    def __init__(self, init: MasterInit, names: list[str], shapes: list[torch.Size], dtype: torch.dtype,
                 device: torch.device):
        self.init, self.names, self.shapes, self.dtype, self.device = init, names, shapes, dtype, device
        self.index, self.values = -1, None

    def __call__(self, i: int) -> torch.Tensor:
        if i != self.index:
            self.values = None  # the previous temporary goes before the next is made
            out = torch.empty(self.shapes[i], dtype=self.dtype, device=self.device)
            self.init(self.names[i], out)
            self.index, self.values = i, out.view(-1)
        return self.values


def bind_params(model: nn.Module, params: list[nn.Parameter], values: list[torch.Tensor]) -> list[nn.Parameter]:
    """Bind ``params[i]`` to ``values[i]``: ``p.data`` for a parameter with storage, a replacing
    ``nn.Parameter`` (same attributes and ``requires_grad``) in every module of ``model`` for a meta
    one. Returns the parameters now in the model, in ``params``' order."""
    fresh: dict[int, nn.Parameter] = {}
    out = []
    for p, v in zip(params, values):
        if not on_meta(p):
            p.data = v
            out.append(p)
            continue
        new = nn.Parameter(v, requires_grad=p.requires_grad)
        own = vars(new)
        for key, attr in vars(p).items():  # a fake tensor's own fields (its device) stay the new one's
            if key not in own:
                setattr(new, key, attr)
        fresh[id(p)] = new
        out.append(new)
    if fresh:
        for m in model.modules():
            for key, p in m._parameters.items():
                if p is not None and id(p) in fresh:
                    m._parameters[key] = fresh[id(p)]
    return out


@torch.no_grad()
def cast_frozen(model: nn.Module, dtype: torch.dtype, master_dtype: torch.dtype, device: torch.device,
                master_init: MasterInit | None) -> None:
    """Non-trainable floating parameters in the parameters' dtype: cast in place, or, on meta, drawn
    in ``master_dtype`` by ``master_init`` and rounded, as a model built in ``master_dtype`` is cast."""
    for name, p in list(model.named_parameters()):
        if p.requires_grad or not p.is_floating_point():
            continue
        if not on_meta(p):
            p.data = p.data.to(dtype)
            continue
        tmp = torch.empty(p.shape, dtype=master_dtype, device=device)
        master_init(name, tmp)
        bind_params(model, [p], [tmp.to(dtype)])
