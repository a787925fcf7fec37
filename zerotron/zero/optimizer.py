"""ZeroOptimizer: one front for plain DP and ZeRO-DP stages 1-3 (Pos, Pos+g, Pos+g+p; ZeRO §5).

It owns the flat layout (``partition``), the gradient buckets (``grad_reduce``), the parameter
gathering of stage 3 (``stage3``), the AdamW math (``adam``), the global norm (``clip``) and the
loss scale (``loss_scaler``); this file only wires them into the step. Where the fp32 state and
the stage-3 partition live and how they cross the wire (ZeRO-Offload, ZeRO-Infinity, ZeRO++) are
strategies chosen once by ``strategy_choice.build``, so the step below has one code path. Life of a step:

1. ``backward`` (per micro-batch): scaled loss backward; hooks reduce full buckets over DP
   (stage 0-1: only on the last micro-batch; stage 2-3: every time, into the gradient partition).
2. ``step``: global squared norm of the reduced shards (one all-reduce, which also carries the
   gradients the norm de-duplicates away: inf/NaN in any = fp16 overflow, skipped on every rank),
   unscale and clip while staging each chunk's shard to fp32, AdamW on the fp32 master shard,
   write the 16-bit shard back, all-gather the updated parameters (stages 1-2; stage 3 gathers
   them lazily at the next forward). Comm volume: 2Ψ for stages 0-2, 3Ψ for 3 (§7). The norm
   and the clipping coefficient stay 0-dim device tensors (``grad_norm`` in the step's dict too):
   only fp16 reads the overflow flag, the one host read of its step (``parallel.host_sync``).

In fp32 precision without offload the master weights are not a copy: ``self.masters[c]`` is this
rank's shard of chunk ``c`` inside the parameter storage itself (the flat parameter buffer for
stages 0-2, the parameter partition for stage 3), so AdamW updates the parameters in place and
no master->parameter copy happens (K = 8 instead of 12). 16-bit runs keep a separate fp32 master.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync
from zerotron.parallel.shard_info import shard_info
from zerotron.zero import accounting, strategy_choice
from zerotron.zero.adam import FlatAdamW
from zerotron.zero.clip import clip_coef, counts_in_norm, global_norm, local_sq_norm
from zerotron.zero.config import ZeroConfig
from zerotron.zero.grad_reduce import GradReducer
from zerotron.zero.loss_scaler import LossScaler, make_loss_scaler
from zerotron.zero.materialize import MasterInit, ParamDraws, bind_params, cast_frozen, check_meta, on_meta
from zerotron.zero.partition import Layout
from zerotron.zero.plan import plan_groups
from zerotron.zero.stage3 import ParamGatherer
from zerotron.zero.state_io import PartitionStateIO

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


class ZeroOptimizer(PartitionStateIO):
    """The parameters' logical view: ``p.data`` is rebound to views of the flat buffers and, in stage 3,
    to an empty tensor between gathers, so ``p.shape`` holds only while ``p`` is gathered. The
    attribute ``param_shapes`` (name -> TP-local shape) and ``logical_shape(p)`` always tell the truth.
    A model built on the meta device gets new parameter objects in its modules (``materialize``).

    The strategies are public: ``state`` (``OptimizerStateStore``) and ``shards`` (stage 3's
    ``ShardSource``, else None)."""

    def __init__(self, model: nn.Module, grid, cfg: ZeroConfig, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, clip_grad: float | None = None,
                 stage3_units: list[nn.Module] | None = None, precision: str = "fp32",
                 loss_scaler: LossScaler | None = None, master_init: MasterInit | None = None,
                 device: torch.device | str | None = None, adam_w_mode: bool = True):
        """``precision``: fp32 | fp16 | bf16 | fp64 (``PRECISIONS``), the dtype of the parameters;
        masters are ``promote_types(dtype, fp32)``, gradients accumulate in ``cfg.grad_accum(precision)``
        (fp32 for 16-bit runs unless ``grad_accum_dtype`` says otherwise). ``loss_scaler``: default
        ``make_loss_scaler(precision)`` (dynamic for fp16 with DeepSpeed's defaults).
        ``adam_w_mode=False``: weight decay as Adam's L2 term instead of AdamW's (``adam.FlatAdamW``).

        ``master_init(name, out)`` (``materialize.MasterInit``, e.g. ``GPT.init_parameter_``): the
        initial values come from it, drawn per parameter in the master dtype, instead of from the
        parameters, which may then be on the meta device (built with no storage; they are replaced
        by parameters over the optimizer's buffers, see ``materialize``). ``device``: where the
        storage goes, default the parameters' device; required for a meta model."""
        cfg.validate(precision=precision)
        if loss_scaler is not None and loss_scaler.scaled != (precision == "fp16"):
            raise ValueError(f"loss_scaler: a {'loss-scaling' if loss_scaler.scaled else 'constant'} scaler with "
                             f"precision={precision!r}; only fp16 scales the loss -- use "
                             f"make_loss_scaler(precision, ...)")
        _check_hyper(lr, betas, eps, weight_decay, clip_grad)
        check_meta(model, master_init)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ZeroOptimizer: the model has no parameter with requires_grad=True")
        self.model, self.grid, self.cfg, self.stage = model, grid, cfg, cfg.stage
        self.lr, self.betas, self.eps, self.weight_decay, self.clip_grad = lr, tuple(betas), eps, weight_decay, clip_grad
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        del named  # _init_storage replaces a meta model's parameters: hold them nowhere else
        for i, name in enumerate(self.names):  # sharding is declared where a parameter is made, never assumed
            shard_info(self.params[i], name)
        self.num_params = sum(p.numel() for p in self.params)
        self.precision, self.dtype = precision, DTYPES[precision]
        self.master_dtype = torch.promote_types(self.dtype, torch.float32)  # 16-bit runs keep fp32 masters
        self.grad_dtype = DTYPES[cfg.grad_accum(precision)]  # gradients accumulate and reduce in it
        self.master_init = master_init
        self.device = self.params[0].device if device is None else torch.device(device)
        if self.device.type == "meta":
            raise ValueError("ZeroOptimizer: the parameters are on the meta device; pass device= for their storage")
        dp = grid.dp_cp_group
        shards, rank = (dp.size, dp.rank_of(grid.rank)) if cfg.stage >= 1 else (1, 0)
        groups, persistent, unit_mods, unit_groups = plan_groups(model, self.params, self.names, grid, cfg,
                                                                 stage3_units)
        self.layout = Layout([p.shape for p in self.params], groups, shards, rank,
                             cfg.bucket_elements(max(p.numel() for p in self.params)), persistent)
        self.param_shapes = dict(zip(self.names, self.layout.shapes))
        no_decay = [len(shape) < 2 for shape in self.layout.shapes]  # params may be released (stage 3)
        self.decay_segments = [self.layout.segments(c, lambda i: not no_decay[i]) for c in self.layout.chunks]
        plan = strategy_choice.build(cfg, grid, self.layout, self.dtype, self.master_dtype, self.device, owner=self,
                                grad_dtype=self.grad_dtype)
        self.state, self.shards = plan.state, plan.shards
        self.adam = FlatAdamW(self.state.device, adam_w_mode=adam_w_mode)
        max_shard = max(c.shard for c in self.layout.chunks)
        self.gather_in = torch.empty(max_shard, dtype=self.dtype, device=self.device) if 1 <= cfg.stage <= 2 else None
        cast_frozen(model, self.dtype, self.master_dtype, self.device, master_init)
        self._init_storage()  # may broadcast from DP rank 0 (build created the node groups before it)
        flat = cfg.stage <= 1 and cfg.contiguous_gradients
        self.reducer = GradReducer(self.layout, self.params, dp, cfg.stage, flat, cfg.overlap_comm,
                                   self.grad_dtype, self.device, scatter=plan.scatter, param_dtype=self.dtype)
        self.gatherer = None
        if cfg.stage == 3:
            self.part_param = self.shards.adopt(self.part_param)  # empty when the partition went to a file
            self.gatherer = ParamGatherer(self.layout, self.params, unit_mods, unit_groups, model, self.shards,
                                          plan.gather, self.dtype, self.device, cfg.stage3_prefetch_bucket_size,
                                          cfg.stage3_max_live_parameters, cfg.stage3_max_reuse_distance)
        self.scaler = loss_scaler or make_loss_scaler(precision)
        counted = [counts_in_norm(p, grid.tp_rank, n) for n, p in zip(self.names, self.params)]
        self.norm_segments = [self.layout.segments(c, lambda i: counted[i]) for c in self.layout.chunks]
        # what the norm de-duplicates away still decides an overflow (clip.global_norm)
        self.skip_segments = [self.layout.segments(c, lambda i: not counted[i]) for c in self.layout.chunks]
        self.norm_group = grid.world_group if cfg.stage >= 1 else grid.mp_group
        self._no_sync = False
        self.reducer.sync = self._default_sync()
        self._mark = grid.stats.snapshot()
        self.comm_per_step: dict = {}

    # construction helpers -------------------------------------------------------------------------
    def _init_storage(self) -> None:
        """Fill the master shard and the 16-bit storage one chunk at a time, from the fp32 values
        ``master_init`` draws (the same on every DP rank: no communication) or else from DP rank 0's
        parameters (a broadcast); then bind the parameters to that storage."""
        lay, dp, st = self.layout, self.grid.dp_cp_group, self.state
        draws = None if self.master_init is None else ParamDraws(
            self.master_init, self.names, lay.shapes, self.master_dtype, self.device)
        self.flat_param = self.part_param = None
        if self.stage < 3:
            self.flat_param = torch.zeros(lay.full_numel, dtype=self.dtype, device=self.device)
        else:
            self.part_param = torch.zeros(lay.part_numel, dtype=self.dtype, device=self.device)
        st.attach(lay, self.decay_segments, [self._param_shard(c) for c in lay.chunks])
        tmp = torch.empty(max(c.numel for c in lay.chunks), dtype=self.master_dtype, device=self.device)
        with torch.no_grad():
            for c in lay.chunks:
                buf = tmp[:c.numel].zero_()
                lo, hi = lay.own_range(c)
                for pc in c.pieces:
                    at, n = pc.offset, pc.end - pc.start
                    if draws is None:
                        buf[at:at + n].copy_(self.params[pc.param].reshape(-1)[pc.start:pc.end])
                    elif self.stage < 3 or (c.offset + at < hi and c.offset + at + n > lo):  # stage 3: own shard
                        buf[at:at + n].copy_(draws(pc.param)[pc.start:pc.end])
                if draws is None:
                    C.broadcast(buf, dp.ranks[0], dp)
                own = buf[lo - c.offset:hi - c.offset]
                if self.stage < 3:
                    self.flat_param[c.offset:c.offset + c.numel].copy_(buf)
                else:
                    self.part_param[c.part_offset:c.part_offset + c.shard].copy_(own)
                st.part_slice("master", c.part_offset, c.shard).copy_(own)  # may be the storage just filled
        st.commit()
        if self.stage < 3:
            self.params = bind_params(self.model, self.params, [lay.param_view(self.flat_param, i)
                                                                for i in range(len(self.params))])
        elif any(on_meta(p) for p in self.params):  # stage 3 binds them to its gathers (stage3.ParamGatherer)
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            self.params = bind_params(self.model, self.params, [empty] * len(self.params))
        self.masters = st.masters  # this rank's fp32 master shard per chunk

    def _param_shard(self, c) -> torch.Tensor:
        """This rank's shard of chunk ``c`` in the parameter storage."""
        if self.stage == 3:
            return self.part_param[c.part_offset:c.part_offset + c.shard]
        lo, hi = self.layout.own_range(c)
        return self.flat_param[lo:hi]

    def logical_shape(self, param: nn.Parameter) -> torch.Size:
        """``param``'s TP-local shape, whatever ``param.data`` is bound to now."""
        for p, shape in zip(self.params, self.layout.shapes):
            if p is param:
                return shape
        raise KeyError("logical_shape: not a trainable parameter of this optimizer")

    def _default_sync(self) -> bool:
        return not self._no_sync and self.stage >= 2

    # training interface ---------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler.scaled else loss

    def backward(self, loss: torch.Tensor, last_microbatch: bool = True) -> None:
        """Backward of ``loss`` (already divided by the number of micro-batches), reducing as ZeRO prescribes."""
        self.reducer.sync = not self._no_sync and (self.stage >= 2 or last_microbatch)
        try:
            self.scale_loss(loss).backward()
            if self.reducer.sync:
                self.reducer.flush()
        finally:
            self.reducer.sync = self._default_sync()
            if self.gatherer is not None:
                self.gatherer.release_all()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward calls inside accumulate gradients locally with no communication (pipeline mode; but
        see ``pipeline_backward``)."""
        self._no_sync, self.reducer.sync = True, False
        try:
            yield
        finally:
            self._no_sync = False
            self.reducer.sync = self._default_sync()

    def pipeline_backward(self, tensors, grad_tensors=None) -> None:
        """One micro-batch's backward of a pipeline schedule (inside ``no_sync``). Stages 0-1 accumulate
        locally until ``reduce_gradients``; stage 2 reduces this backward's buckets into the gradient
        partition as they fill (Pos+g, §5.2), so no full gradient outlives a micro-batch."""
        self.reducer.sync = self.stage == 2
        try:
            torch.autograd.backward(tensors, grad_tensors)
            if self.reducer.sync:  # an interleaved stage's backward reaches one model chunk's buckets
                self.reducer.flush(only_touched=True)
        finally:
            self.reducer.sync = self._default_sync()

    def reduce_gradients(self) -> None:
        """Reduce everything accumulated so far (once per step after ``no_sync`` backward calls)."""
        self.reducer.flush()
        if self.gatherer is not None:
            self.gatherer.release_all()

    def tied_grad(self, param: nn.Parameter) -> torch.Tensor:
        """What the tied copies of ``param`` sum over their group after a pipeline's backwards, in place
        (``model.stages.sync_embedding_grads``): stages 0-1, the gradient accumulated here and not yet
        reduced (not ``param.grad``, which fp32 accumulation of 16-bit parameters leaves empty); stage
        2, this rank's reduced shard -- the same elements on every stage (``plan.tied_index``) -- since
        summing the copies before or after the DP reduction is the same sum."""
        i = next((i for i, p in enumerate(self.params) if p is param), None)
        if i is None:
            raise KeyError("tied_grad: not a trainable parameter of this optimizer")
        if self.stage < 2:
            return self.reducer.local_grad(i)
        if self.stage == 3 or self.layout.groups[0].params != [i]:
            raise ValueError(f"tied_grad({self.names[i]}): zero.stage={self.stage} sums tied copies only for "
                             f"the pipeline's model.word_embedding_weight at stage 2; use zero.stage<=2 with pipelines")
        self.reducer.flush()  # what no_sync backwards left unreduced
        chunks = [self.layout.chunks[ci] for ci in self.layout.groups[0].chunks]
        return self.reducer.grad_range(chunks[0].part_offset, chunks[-1].part_offset + chunks[-1].shard)

    @property
    def updates(self) -> int:
        """Optimizer steps applied so far -- fp16 steps skipped for overflow do not count (Adam's
        bias correction and the learning-rate schedule run on this); saved with the checkpoint."""
        return self.state.step

    def set_lr(self, lr: float, betas=None) -> None:
        """The schedule's rate (and, for a cycled momentum, Adam's betas) for the next step."""
        betas = self.betas if betas is None else tuple(betas)
        _check_hyper(lr, betas, self.eps, self.weight_decay, self.clip_grad)
        self.lr, self.betas = lr, betas

    def step(self) -> dict:
        if self.reducer.pending:
            self.reduce_gradients()
        self.reducer.wait()
        lay, st, scale = self.layout, self.state, self.scaler.scale
        grads = [self.reducer.grad_shard(c) for c in lay.chunks]
        sq, skipped = (local_sq_norm(zip(grads, segs), self.device, self.master_dtype)
                       for segs in (self.norm_segments, self.skip_segments))
        norm, finite = global_norm(sq, skipped, self.norm_group)
        if scale != 1.0:
            norm = norm / scale
        # fp16's skip decision is the step's one host read; a constant scale never skips, so
        # bf16/fp32 read nothing and a non-finite gradient reaches the loss (the trainer's NaN stop)
        overflow = self.scaler.scaled and not host_sync.read(finite, "overflow", placeholder=True)
        if not overflow:
            coef = clip_coef(norm, self.clip_grad, scale)
            st.step += 1
            st.update(self.reducer, self._adamw, coef)
            self._publish()
        self.scaler.update(overflow)
        self.reducer.zero()
        now = self.grid.stats.snapshot()
        self.comm_per_step, self._mark = self.grid.stats.since(self._mark).snapshot(), now
        return {"grad_norm": norm, "skipped": overflow, "loss_scale": self.scaler.scale, "step_loss_scale": scale}

    def _adamw(self, master, grad, exp_avg, exp_avg_sq, decay_segments) -> None:
        self.adam.update(master, grad, exp_avg, exp_avg_sq, self.state.step, self.lr, self.betas, self.eps,
                         self.weight_decay, decay_segments)

    def _publish(self) -> None:
        """Master shards -> 16-bit parameters: all-gathered for stages 1-2, kept partitioned for stage 3."""
        st = self.state
        with torch.no_grad():
            for c in self.layout.chunks:
                if 1 <= self.stage <= 2:
                    self.gather_in[:c.shard].copy_(st.masters[c.index])
                    C.all_gather(self.flat_param[c.offset:c.offset + c.numel], self.gather_in[:c.shard],
                                 self.grid.dp_cp_group)
                    continue
                fresh = st.fresh(c)  # None: the parameters already hold the update
                if fresh is not None and self.stage == 0:
                    self.flat_param[c.offset:c.offset + c.numel].copy_(fresh)
                elif fresh is not None:
                    self.shards.write(c.part_offset, fresh)
        if self.gatherer is not None:
            self.gatherer.release_all()
            self.gatherer.refresh_persistent()

    # accounting -----------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        return accounting.memory_report(self)

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Which live tensors hold parameters, gradients and optimizer states: their identities for
        a memory tracker, which measures the storages itself (``parallel/memory_tracker.py``)."""
        params = [t for t in (*self.params, self.flat_param, self.part_param) if t is not None]
        grads = [p.grad for p in self.params if p.grad is not None] + self.reducer.tensors()
        return {"parameters": params, "gradients": grads, "optimizer_states": self.state.resident()}


def _check_hyper(lr, betas, eps, weight_decay, clip_grad) -> None:
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"lr={lr!r}: must be a number >= 0")
    if len(tuple(betas)) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas={betas!r}: must be two numbers in [0, 1), e.g. (0.9, 0.95)")
    if not eps > 0:
        raise ValueError(f"eps={eps!r}: must be > 0, e.g. 1e-8")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay!r}: must be >= 0")
    if clip_grad is not None and not clip_grad >= 0:
        raise ValueError(f"clip_grad={clip_grad!r}: must be >= 0 (0 or None disables clipping)")
