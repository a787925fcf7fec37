"""The compute of one training step -- micro-batches or the pipeline schedule, then the optimizer
step -- with no host read of a device value.

The trainer (``Trainer.train_step``) keeps what is about the run (learning-rate schedule, fault
drills, the NaN and overflow-storm stops, consumed samples); this function is only the work a
device queue sees, so a dry run can call exactly the trainer's step on synthetic batches
already on the device, and a test can hold it to its host-sync budget (``host_sync.counting``):
none per micro-batch, none per step in bf16/fp32, fp16's overflow decision in the optimizer.

The loss of each micro-batch is summed on the device (float64, the arithmetic of the Python
float sum it replaces); reading it per micro-batch would drain the device queue once per
micro-batch, the stall ZeRO's overlapped gradient reduction (arXiv 1910.02054 §5.2) is meant to
hide behind the next backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class StepResult:
    """``loss_sum``: 0-dim device tensor, the mean loss over this rank's micro-batches -- already
    averaged over DP (and the same on every stage) when ``dp_reduced`` (the pipeline schedule
    reduces it; ``parallel.pipeline.StepOutput``). ``info``: the optimizer's step dict
    (``grad_norm`` a 0-dim device tensor, ``skipped``, ``loss_scale``)."""

    loss_sum: torch.Tensor
    info: dict
    dp_reduced: bool = False


class _NoMemory:
    def phase(self, name: str):
        return contextlib.nullcontext()


def run_step(model, optimizer, batches: Sequence, grid, schedule: str = "1f1b", memory=None) -> StepResult:
    """Forward and backward of ``batches`` (``[(token_ids, labels), ...]`` on the model's device,
    one pair per micro-batch of this DP rank), then ``optimizer.step()``.

    ``grid.pp_size > 1`` runs the pipeline schedule (``model.stages.pipeline_step``: it
    accumulates, syncs the tied embedding and reduces once); otherwise one backward per
    micro-batch, the last one reducing (stages 0-1) as ``ZeroOptimizer.backward`` prescribes.
    ``memory``: a ``StepMemory`` or anything with a ``phase(name)`` context manager, or None."""
    if not batches:
        raise ValueError("run_step: no micro-batches (training.global_batch_size / micro_batch_size / dp >= 1)")
    mem = memory if memory is not None else _NoMemory()
    if grid.pp_size > 1:
        from zerotron.model.stages import pipeline_step

        with mem.phase("forward_backward"):  # the schedule interleaves them
            out = pipeline_step(model, list(batches), optimizer, schedule=schedule)
        with mem.phase("step"):
            info = optimizer.step()
        return StepResult(out.loss, info, dp_reduced=True)
    n = len(batches)
    total = None
    for i, (x, y) in enumerate(batches):
        with mem.phase("forward"):
            loss = model(x, labels=y)
        with mem.phase("backward"):
            optimizer.backward(loss / n, last_microbatch=i == n - 1)
        part = loss.detach().to(torch.promote_types(loss.dtype, torch.float64)) / n
        total = part if total is None else total + part
    with mem.phase("step"):
        info = optimizer.step()
    return StepResult(total, info)


@torch.no_grad()
def eval_step(model, batches: Sequence, grid) -> torch.Tensor:
    """Forward only of ``batches`` (as ``run_step``'s): the mean loss over this rank's
    micro-batches, a 0-dim float64 device tensor, not read on the host. With a pipeline
    (``grid.pp_size > 1``) it runs the schedule's forward order on the wire ``pipeline_step``
    derives (``model.stages.stage_wire``: shape and dtype, 16-bit after the optimizer's cast),
    and every stage gets the last stage's loss. The caller averages over DP."""
    if not batches:
        raise ValueError("eval_step: no micro-batches (training.global_batch_size / micro_batch_size / dp >= 1)")
    if grid.pp_size > 1:
        from zerotron.model.stages import pipeline_eval

        return pipeline_eval(model, list(batches))
    total = None
    for x, y in batches:
        part = model(x, labels=y).to(torch.float64)
        total = part if total is None else total + part
    return total / len(batches)
