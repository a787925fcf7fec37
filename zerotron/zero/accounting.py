"""Per-rank accounting of model states (ZeRO §3.1, §5) and of the collectives of one step (§7).

Model states per rank, in bytes, with Ψ parameters, Nd DP ranks and 16-bit parameters (K = 12):

    baseline DP   2Ψ + 2Ψ + 12Ψ          = 16Ψ
    Pos           2Ψ + 2Ψ + 12Ψ/Nd
    Pos+g         2Ψ + 2Ψ/Nd + 12Ψ/Nd
    Pos+g+p       (2 + 2 + 12)Ψ/Nd

In fp32 runs (on the device) the parameters *are* the fp32 master weights -- there is no second
copy -- so K = 8 (the two Adam moments) and baseline DP holds 4Ψ + 4Ψ + 8Ψ = 16Ψ, not 20Ψ;
``master_fp32`` then reports 0. 16-bit runs keep the paper's K = 12, and their gradients are
accumulated in fp32 by default (``ZeroConfig.grad_accum_dtype``): 4 gradient bytes per parameter
instead of the paper's 2, so baseline DP holds 2Ψ + 4Ψ + 12Ψ = 18Ψ and Pos+g 2Ψ + 16Ψ/Nd; with
``grad_accum_dtype`` equal to the precision the table above holds as written.

``memory_report`` measures the tensors the optimizer actually holds (padding included) and
reports the fixed buffers -- buckets, staging buffers (CB) -- separately, since they do not
grow with the model. The strategies of ``zero.strategies`` report their own bytes by place
(device, host, disk): model states on the device or the host count as held, the host ones are
also ``offloaded_to_host`` (ZeRO-Offload), the disk ones only ``offloaded_to_disk``
(ZeRO-Infinity). Communication is read from the grid's ``CommStats`` as the difference between
two snapshots, so it is exactly what went through ``zerotron.parallel.collectives``.
"""

from __future__ import annotations

from zerotron.zero.strategies import merge_reports


def nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def expected_model_state_bytes(psi: int, dp: int, stage: int, param_bytes: int = 2, k: int = 12,
                               grad_bytes: int | None = None) -> float:
    """The paper's formula for one rank (ZeRO §5.4), for comparing with ``memory_report``;
    ``grad_bytes`` (default ``param_bytes``, the paper's) is 4 when 16-bit runs accumulate in fp32."""
    p, g = param_bytes, param_bytes if grad_bytes is None else grad_bytes
    if stage == 0:
        return (p + g + k) * psi
    if stage == 1:
        return (p + g) * psi + k * psi / dp
    if stage == 2:
        return p * psi + (g + k) * psi / dp
    return (p + g + k) * psi / dp


MODEL_STATES = ("params", "grads", "master_fp32", "optimizer_moments", "secondary_params")


def memory_report(opt) -> dict:
    """Bytes of each model-state class this rank holds, fixed buffers apart."""
    grads, fixed = opt.reducer.buffer_bytes()
    core = {"device": {"params": nbytes(opt.flat_param), "grads": grads,
                       "fixed_buffers": fixed + nbytes(opt.gather_in)}}
    places = merge_reports(core, opt.state.memory_report(),
                           opt.gatherer.memory_report() if opt.gatherer is not None else {})
    device, host, disk = (places.get(place, {}) for place in ("device", "host", "disk"))
    held = {kind: device.get(kind, 0) + host.get(kind, 0) for kind in MODEL_STATES}
    key = "params" if opt.dtype == opt.master_dtype else "params_16bit"
    return {
        key: held["params"],
        "grads": held["grads"],
        "master_fp32": held["master_fp32"],
        "optimizer_moments": held["optimizer_moments"],
        "fixed_buffers": sum(p.get("fixed_buffers", 0) for p in places.values()),
        "secondary_params": held["secondary_params"],
        "total_model_states": sum(held.values()),
        "offloaded_to_host": sum(host.get(kind, 0) for kind in MODEL_STATES),
        "offloaded_to_disk": sum(n for kind, n in disk.items() if kind in MODEL_STATES),
        # host RAM the pinned buffers hold beyond their size (power-of-two blocks; host_sync)
        "pinned_rounding": host.get("pinned_rounding", 0),
    }


def io_report(opt) -> dict:
    """Disk traffic of the strategies that have a disk tier: ``disk`` (optimizer state), ``param_disk``
    (the stage-3 parameter partition); absent when in memory."""
    out = {"disk": opt.state.io_report(), "param_disk": opt.shards.io_report() if opt.shards is not None else {}}
    return {key: value for key, value in out.items() if value}
