"""How each parameter is laid out over tensor-parallel ranks: exactly one ``ShardInfo`` per parameter.

The global gradient norm, checkpoint resharding and export all need to know, for every
parameter, whether TP ranks hold slices of it or whole copies, and whether it is the last
pipeline stage's copy of the tied word embedding. A wrong guess fails silently -- a split weight
taken for replicated is counted on TP rank 0 only and shrinks the norm, and a resharded
checkpoint stacks copies where it should concatenate slices -- so ``shard_info`` has no default.
Every parameter gets its ``ShardInfo`` where it is made (``zerotron.parallel.tensor_parallel``,
``zerotron.model``); plain torch modules are marked explicitly with ``mark_replicated``.

The info lives on the ``nn.Parameter`` object, not on its tensor: the ZeRO optimizer rebinds
``p.data`` to views of flat buffers (stage 3 releases it altogether), and the object with its
attributes survives that, as it does ``module.to(dtype)``. ``copy.deepcopy`` does not carry
attributes of a Parameter, so a deep-copied model has to be marked again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_ATTR = "_zerotron_shard"


class ShardInfoError(ValueError):
    """A parameter without ``ShardInfo``, or one whose ``ShardInfo`` contradicts its shape."""


@dataclass(frozen=True)
class ShardInfo:
    """``tp_split_dim``: the dimension TP ranks hold equal, contiguous slices of (rank r the r-th);
    ``None`` when every TP rank holds the whole tensor (LayerNorm, position table, row-parallel
    biases), which the gradient norm then counts on TP rank 0 only.

    ``global_shape``: the full, unsharded shape (with the vocabulary padded for this TP size), the
    shape checkpoints record and reshard from.

    ``embedding_copy``: this is the last pipeline stage's copy of the tied word embedding
    (``GPT.word_embedding_copy``). It equals the first stage's embedding and, after
    ``sync_embedding_grads``, has the same gradient, so the norm never counts it and checkpoints
    store it under the embedding's own name.
    """

    tp_split_dim: int | None
    global_shape: tuple[int, ...]
    embedding_copy: bool = False

    def __post_init__(self):
        shape = tuple(int(d) for d in self.global_shape)
        if any(d < 0 for d in shape):
            raise ShardInfoError(f"ShardInfo.global_shape={shape} has a negative dimension")
        object.__setattr__(self, "global_shape", shape)
        dim = self.tp_split_dim
        if dim is not None and not (isinstance(dim, int) and 0 <= dim < len(shape)):
            raise ShardInfoError(f"ShardInfo.tp_split_dim={dim!r} is not a dimension of global_shape={shape}; "
                                 f"use 0..{len(shape) - 1}, or None for a TP-replicated parameter")

    @property
    def replicated(self) -> bool:
        """Every TP rank holds the whole tensor."""
        return self.tp_split_dim is None

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """The shape one of ``tp_size`` TP ranks holds."""
        shape = list(self.global_shape)
        if self.tp_split_dim is not None:
            d = self.tp_split_dim
            if shape[d] % tp_size:
                raise ShardInfoError(f"global shape {self.global_shape} does not split into {tp_size} equal "
                                     f"slices along dimension {d}; choose a TP size that divides {shape[d]}")
            shape[d] //= tp_size
        return tuple(shape)

    @classmethod
    def from_local(cls, local_shape, tp_split_dim: int | None, tp_size: int, embedding_copy: bool = False) -> "ShardInfo":
        """The info of a parameter whose TP-local slice has ``local_shape``."""
        shape = [int(d) for d in local_shape]
        if tp_split_dim is not None:
            if not 0 <= tp_split_dim < len(shape):
                raise ShardInfoError(f"tp_split_dim={tp_split_dim} is not a dimension of shape {tuple(shape)}")
            shape[tp_split_dim] *= tp_size
        return cls(tp_split_dim, tuple(shape), embedding_copy)


def _describe(param: torch.Tensor, name: str | None) -> str:
    what = f"parameter {name!r}" if name else "a parameter"
    return f"{what} of shape {tuple(param.shape)}"


def set_shard_info(param: nn.Parameter, info: ShardInfo) -> nn.Parameter:
    """Attach ``info`` to ``param`` after checking it against the parameter's TP-local shape."""
    if not isinstance(info, ShardInfo):
        raise ShardInfoError(f"set_shard_info: expected a ShardInfo, got {type(info).__name__}")
    local, glob, d = tuple(param.shape), info.global_shape, info.tp_split_dim
    if d is None:
        consistent = local == glob
    else:
        consistent = (len(local) == len(glob) and local[d] > 0 and glob[d] % local[d] == 0
                      and all(a == b for i, (a, b) in enumerate(zip(local, glob)) if i != d))
    if not consistent:
        raise ShardInfoError(f"ShardInfo(tp_split_dim={d}, global_shape={glob}) does not fit {_describe(param, None)}: "
                             f"a replicated parameter has the global shape, a split one differs from it only "
                             f"along tp_split_dim by a whole factor")
    setattr(param, _ATTR, info)
    return param


def has_shard_info(param: torch.Tensor) -> bool:
    return isinstance(getattr(param, _ATTR, None), ShardInfo)


def shard_info(param: torch.Tensor, name: str | None = None) -> ShardInfo:
    """The parameter's ``ShardInfo``; raises ``ShardInfoError`` if it was never given one."""
    info = getattr(param, _ATTR, None)
    if not isinstance(info, ShardInfo):
        raise ShardInfoError(
            f"{_describe(param, name)} has no ShardInfo, so its tensor-parallel layout is unknown: create it "
            f"through the TP layers (zerotron.parallel.tensor_parallel.tp_param, ColumnParallelLinear, ...) "
            f"or attach one with zerotron.parallel.shard_info.set_shard_info; for a plain torch module whose "
            f"parameters every TP rank holds whole, call mark_replicated(module) (again after copy.deepcopy)")
    return info


def mark_replicated(module: nn.Module) -> nn.Module:
    """Give every parameter of ``module`` that has no ``ShardInfo`` a TP-replicated one; returns ``module``.

    For plain torch modules (tests, benchmarks) whose every parameter each TP rank holds whole.
    Call it before the ZeRO optimizer is built: stage 3 releases ``p.data``, and the global shape
    is read from the parameter's current shape.
    """
    for p in module.parameters():
        if not has_shard_info(p):
            set_shard_info(p, ShardInfo(None, tuple(p.shape)))
    return module
