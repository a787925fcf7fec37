"""Per-rank accounting of model states (ZeRO §3.1, §5) and of the collectives of one step (§7).

Model states per rank, in bytes, with Ψ parameters, Nd DP ranks and 16-bit parameters (K = 12):

    baseline DP   2Ψ + 2Ψ + 12Ψ          = 16Ψ
    Pos           2Ψ + 2Ψ + 12Ψ/Nd
    Pos+g         2Ψ + 2Ψ/Nd + 12Ψ/Nd
    Pos+g+p       (2 + 2 + 12)Ψ/Nd

In fp32 runs (on the device) the parameters *are* the fp32 master weights -- there is no second
copy -- so K = 8 (the two Adam moments) and baseline DP holds 4Ψ + 4Ψ + 8Ψ = 16Ψ, not 20Ψ;
``master_fp32`` then reports 0. 16-bit runs keep the paper's K = 12.

``memory_report`` measures the tensors the optimizer actually holds (padding included) and
reports the fixed buffers -- buckets, staging buffers (CB) -- separately, since they do not
grow with the model. Communication is read from the grid's ``CommStats`` as the difference
between two snapshots, so it is exactly what went through ``zerotron.parallel.collectives``.
"""

from __future__ import annotations


def nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def expected_model_state_bytes(psi: int, dp: int, stage: int, param_bytes: int = 2, k: int = 12) -> float:
    """The paper's formula for one rank (ZeRO §5.4), for comparing with ``memory_report``."""
    g = param_bytes
    if stage == 0:
        return (2 * g + k) * psi
    if stage == 1:
        return 2 * g * psi + k * psi / dp
    if stage == 2:
        return g * psi + (g + k) * psi / dp
    return (2 * g + k) * psi / dp


def memory_report(opt) -> dict:
    """Bytes of each model-state class this rank holds, fixed buffers apart."""
    if opt.stage < 3:
        params = nbytes(opt.flat_param)
    else:
        params = nbytes(opt.part_param) + opt.gatherer.resident_bytes()
    grads, fixed = opt.reducer.buffer_bytes()
    master, moments = opt.state.state_bytes()
    fixed += opt.state.staging_bytes() + nbytes(opt.gather_in)
    key = "params" if opt.dtype == opt.master_dtype else "params_16bit"
    # hpZ's secondary parameter partition is held model state; ZeRO-Infinity's disk is not
    secondary = opt.gatherer.secondary_bytes() if opt.gatherer is not None else 0
    disk = opt.state.disk_bytes() if hasattr(opt.state, "disk_bytes") else 0
    if getattr(opt, "param_disk", None) is not None:  # ZeRO-Infinity: the parameter partition is in a file
        disk += opt.param_disk.disk_bytes()
        fixed += opt.param_disk.staging_bytes()
    return {
        key: params,
        "grads": grads,
        "master_fp32": master,
        "optimizer_moments": moments,
        "fixed_buffers": fixed,
        "secondary_params": secondary,
        "total_model_states": params + grads + master + moments + secondary,
        "offloaded_to_host": master + moments if opt.cfg.offload_optimizer else 0,
        "offloaded_to_disk": disk,
    }


def snapshot_diff(after: dict, before: dict) -> dict:
    """``CommStats.snapshot()`` entries that changed between two snapshots, as differences."""
    out = {}
    for key, now in after.items():
        then = before.get(key, {"calls": 0, "elements": 0, "bytes": 0})
        delta = {k: now[k] - then.get(k, 0) for k in now}
        if delta["calls"]:
            out[key] = delta
    return out
