"""What a GPT's transformer layers keep for backward, measured two ways that share no code with the
memory model (``zerotron.estimate.activations``) nor with the checkpoint store's own accounting.

* **saved**: every tensor autograd saves during the forward of the blocks, seen by
  ``torch.autograd.graph.saved_tensors_hooks``: its own extent (elements × element size; two
  saves of the same region counted once), parameters left out. This is how Korthikanti et al.
  count (a tensor per saved input); it sees nothing a checkpoint keeps outside autograd.
* **freed**: the floating-point storages born in the forward (a ``TorchDispatchMode`` sees every
  operator's outputs) that are still alive after it and die when the graph is dropped -- what
  the allocator really holds for backward: a saved view keeps its whole storage, the checkpoint
  store's copies (Pa pieces, host copies) are counted, buffers a library caches are not. The
  output itself is left out, and so is the input (a fresh non-leaf whose reference is dropped:
  it counts only if something kept it).

Shared by ``tests/activation/test_selective_recompute.py`` and ``scripts/bench/activation_memory.py``.
"""

from __future__ import annotations

import gc
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class SavedCensus:
    """Bytes of the non-parameter tensors autograd saves while it is active."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[tuple[int, int, torch.dtype]] = set()
        self.bytes = 0
        self.tensors: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += t.numel() * t.element_size()
                self.tensors.append((tuple(t.shape), t.dtype))
        return t.detach()  # not t: a saved output would then hold its own node (a cycle gc cannot free)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class _Births(TorchDispatchMode):
    """Every floating-point storage an operator creates while active (weakly held)."""

    def __init__(self) -> None:
        super().__init__()
        self.born = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self.born:
                    self.born[st] = st.nbytes()
        return out


def _settle(refs, quiet: int = 5, pause_s: float = 0.005, limit_s: float = 2.0) -> None:
    """Wait until no more of ``refs`` die for ``quiet`` pauses: a backend's worker thread may drop
    its reference to a collective's tensor a moment after the call returned."""
    dead, same, waited = -1, 0, 0.0
    while same < quiet and waited < limit_s:
        now = sum(r() is None for r in refs)
        same, dead = (same + 1, dead) if now == dead else (0, now)
        time.sleep(pause_s)
        waited += pause_s


def measure_blocks(model, x: torch.Tensor) -> dict:
    """Run ``model.run_blocks`` (checkpointing and selective recompute as installed) on a fresh copy
    of ``x`` with grad, then drop its graph; returns ``saved`` and ``freed`` bytes for all of the
    model's blocks (``freed_host``: the part in CPU memory while the model runs elsewhere; 0 on a
    CPU-only run, where host and device are one memory) and the saved tensors' shapes."""
    births = _Births()
    census = SavedCensus(model.parameters())
    leaf = x.detach().clone().requires_grad_(True)  # held by its AccumulateGrad node: born outside
    collecting = gc.isenabled()
    gc.disable()  # reference counting alone decides what dies: a collection in between made runs differ
    try:
        with births, census:
            inp = leaf * 1.0  # as the embedding's output: not a leaf, kept only if something saves it
            out = model.run_blocks(inp)
        del inp
        _settle([weakref.ref(st) for st in list(births.born.keys())])
        alive = [(weakref.ref(st), n, st.device.type) for st, n in list(births.born.items())]
        out_bytes = out.untyped_storage().nbytes()
        del out  # the graph holds no cycle (``SavedCensus`` packs detached tensors): it dies here
        _settle([ref for ref, _, _ in alive])
    finally:
        if collecting:
            gc.enable()
    freed = {"device": 0, "host": 0}
    for ref, n, dev in alive:
        if ref() is None:
            freed["host" if dev == "cpu" and x.device.type != "cpu" else "device"] += n
    freed["device"] -= out_bytes
    return {"saved": census.bytes, "freed": freed["device"] + freed["host"], "freed_host": freed["host"],
            "saved_tensors": census.tensors}


# The rows of the manual's table (docs/parallelism.md): (sequence_parallel,
# activation_checkpointing fields). "full" is one checkpoint per layer; Pa+cpu partitions over TP
# and offloads.
ROWS: dict[str, tuple[bool, dict]] = {
    "none": (False, {}),
    "SP": (True, {}),
    "selective": (False, {"recompute_granularity": "selective"}),
    "SP+selective": (True, {"recompute_granularity": "selective"}),
    "full": (False, {"checkpoint_activations": True}),
    "full+Pa": (False, {"checkpoint_activations": True, "partition_activations": True}),
    "full+SP": (True, {"checkpoint_activations": True}),
    "Pa+cpu": (False, {"checkpoint_activations": True, "partition_activations": True, "cpu_checkpointing": True}),
}


def measure_row(name: str, model_cfg, grid, micro_batch: int, dtype=torch.float32, seed: int = 1,
                input_ids: torch.Tensor | None = None) -> dict:
    """Build the GPT of ``ROWS[name]`` on ``grid`` and measure its blocks (``measure_blocks``),
    per layer: ``saved``, ``freed`` and ``freed_host`` divided by the number of layers.
    ``input_ids`` [b, s]: the packed sample whose documents the blocks' attention then masks
    (``model.reset_attention_mask``), laid out by the model's own ``embed``."""
    from zerotron.activation import ActivationCheckpointConfig, apply_activation_checkpointing
    from zerotron.model import GPT

    sp, fields = ROWS[name]
    model = GPT(model_cfg, grid, dtype=dtype, seed=seed, sequence_parallel=sp)
    apply_activation_checkpointing(model, grid, ActivationCheckpointConfig(**fields).validate())
    x = torch.randn(model.hidden_shape(micro_batch), dtype=dtype)
    if input_ids is not None:
        with torch.no_grad():
            model.embed(input_ids)  # sets each block's document layout; the output is not used
    got = measure_blocks(model, x)
    layers = len(model.blocks)
    return {k: got[k] / layers for k in ("saved", "freed", "freed_host")}
