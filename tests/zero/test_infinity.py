"""ZeRO-Infinity (arXiv 2104.07857): stage 3 with the optimizer state on local disk.

* fp32 parameters after 5 steps equal stage 3 without offload exactly (tiles of 1000 elements,
  buffer_count 2, so the read-ahead / write-behind bound is exercised), and so do the moments;
* the model states in (process) memory drop to params + grads as ``expected_infinity_bytes``
  predicts, master and moments are reported under ``offloaded_to_disk``;
* a checkpoint round trip (partition_state -> load_partition_state) through the disk state;
* config: DeepSpeed nested dicts, errors naming the key, trainer config;
* ``offload_param`` on NVMe (the stage-3 parameter partition in a file, ``nvme_params``): 5 steps
  equal plain stage 3 bit for bit on 2 and 4 ranks (with and without all-gather prefetch, so both the
  async gather of disk shards and the disk read-ahead run), the partition is reported under
  ``offloaded_to_disk`` and no longer in ``params``, and a checkpoint saved with params on disk
  loads into plain stage 3, which then continues identically.
"""

import json

import pytest
import torch

from tests.harness import spawn
from zerotron.testing.zero_runs import train_gpt


def _nvme(path, **kw):
    return dict(stage=3, offload_optimizer_device="nvme", offload_optimizer_nvme_path=str(path), sub_group_size=1000,
                offload_optimizer_buffer_count=2, **kw)


def check_nvme_equals_stage3(path):
    from zerotron.zero.infinity.disk_optimizer_state import expected_infinity_bytes

    base = train_gpt(dict(stage=3), 5, want_params=True)
    disk = train_gpt(_nvme(path), 5, want_params=True)
    for name, value in base["params"].items():
        assert torch.equal(disk["params"][name], value), name
    psi, dp = disk["psi"], torch.distributed.get_world_size()
    want = expected_infinity_bytes(psi, dp, param_bytes=4)
    mem, ref = disk["memory"], base["memory"]
    assert mem["master_fp32"] == 0 and mem["optimizer_moments"] == 0
    assert abs(mem["total_model_states"] - want["device"]) <= 0.02 * want["device"], (mem, want)
    assert abs(mem["offloaded_to_disk"] - want["disk"]) <= 0.02 * want["disk"], (mem, want)
    assert ref["total_model_states"] - mem["total_model_states"] == ref["optimizer_moments"]  # fp32: K=8 left
    per_step = 2 * 12 * disk["part_numel"]  # every tile read once and written once
    assert disk["disk"]["read"] >= 5 * per_step // 2 and disk["disk"]["written"] >= 5 * per_step // 2
    return mem, want


def test_nvme_offload_equals_stage3_and_frees_memory(tmp_path):
    for mem, want in spawn(check_nvme_equals_stage3, 2, str(tmp_path), timeout=100):
        print(mem, want)
    assert not any(tmp_path.rglob("*.f32")), "state files are removed with the optimizer"


def check_checkpoint_round_trip(path):
    from zerotron.model.config import GPTConfig
    from zerotron.model.gpt import GPT
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    from zerotron.testing.zero_runs import GPT_SHAPE

    grid = Grid(ParallelDims())
    outs = []
    for kw in (dict(stage=3, offload_optimizer=True), _nvme(path)):
        model = GPT(GPTConfig(**GPT_SHAPE), grid, seed=11)
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage3_param_persistence_threshold=0, **kw), lr=1e-2)
        x = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(grid.rank))
        opt.backward(model(x[:, :-1], labels=x[:, 1:]))
        opt.step()
        outs.append((opt, {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.partition_state().items()}))
    (ref_opt, ref), (opt, got) = outs
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ref[key], got[key]), key
    index = {name: (s, off) for name, s, e, off in opt.partition_index()}
    state = {k: ref[k] * 0 + 1.5 for k in ("master", "exp_avg", "exp_avg_sq")}  # load distinct values

    def read(name, key, start, end):
        s, off = index[name]
        return state[key][off + start - s:off + end - s]

    opt.load_partition_state(read, step=7)
    assert torch.equal(opt.state.master, state["master"]) and opt.state.step == 7
    opt.state.commit()  # written through to disk, then re-read
    assert torch.equal(opt.state.exp_avg_sq, state["exp_avg_sq"])
    assert torch.all(opt.part_param == 1.5)
    return True


def test_checkpoint_round_trip_through_disk(tmp_path):
    assert all(spawn(check_checkpoint_round_trip, 2, str(tmp_path), timeout=100))


@pytest.mark.parametrize("zero,match", [
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "zero.offload_param_nvme_path"),
    ({"stage": 3, "offload_param": {"device": "disk"}}, "offload_param.device='disk'"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 1}},
     "zero.offload_param_buffer_count"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", "ratio": 1}}, "offload_param.ratio"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "zero.offload_optimizer_device"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "zero.offload_optimizer_nvme_path"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 1}},
     "zero.offload_optimizer_buffer_count"),
    ({"stage": 3, "offload_optimizer": {"device": "disk"}}, "offload_optimizer.device='disk'"),
    ({"stage": 3, "sub_group_size": -1}, "sub_group_size=-1: must be an integer >= 0"),
])
def test_config_errors_name_the_key(zero, match):
    with pytest.raises(ValueError, match=match):
        zero_from_deepspeed(zero)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_parameter_offload_below_stage_3(device):
    """zerotron's own key is refused below stage 3 (parameters are not partitioned there); a
    DeepSpeed JSON's ``offload_param`` is dropped with a start-up line, as DeepSpeed reads it only
    at stage 3."""
    from zerotron.config.deepspeed import from_deepspeed
    from zerotron.zero.config import ZeroConfig

    with pytest.raises(ValueError, match=f"zero.offload_param_device='{device}'"):
        ZeroConfig(stage=2, offload_param_device=device, offload_param_nvme_path="/x").validate()
    cfg, lines = from_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": device,
                                                                                      "nvme_path": "/x"}}})
    assert (cfg.zero.offload_param_device, cfg.zero.offload_param_nvme_path) == ("none", None)
    assert any("accepted, no effect here: zero_optimization.offload_param" in line for line in lines), lines


def zero_from_deepspeed(zero: dict):
    """The ZeroConfig the one DeepSpeed reader (``config.deepspeed``) makes of a zero_optimization dict."""
    from zerotron.config.deepspeed import from_deepspeed

    return from_deepspeed({"zero_optimization": zero})[0].zero.validate()


def test_deepspeed_nested_offload_dict(tmp_path):
    from zerotron.config.cli import parse_config

    zero = {"stage": 3, "sub_group_size": 1e6, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5},
            "offload_param": {"device": "none"}}
    cfg = zero_from_deepspeed(zero)
    assert (cfg.optimizer_offload, cfg.offload_optimizer_nvme_path, cfg.offload_optimizer_buffer_count,
            cfg.sub_group_size) == ("nvme", str(tmp_path), 5, 1_000_000)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": zero}))
    run = parse_config(["--deepspeed-config", str(ds)])
    z = run.zero
    assert (z.offload_optimizer, z.offload_optimizer_device, z.offload_optimizer_nvme_path,
            z.offload_optimizer_buffer_count) == (True, "nvme", str(tmp_path), 5)
    assert (z.sub_group_size, z.zero_hpz_partition_size, z.zero_quantized_weights) == (1_000_000, 2, True)
    run.training.global_batch_size = 32
    zc = run.validate(4).zero
    assert zc.optimizer_offload == "nvme" and zc.zero_hpz_partition_size == 2
    run.zero.zero_hpz_partition_size = 3
    with pytest.raises(ValueError, match="zero.zero_hpz_partition_size=3"):
        run.validate(4)
    old = parse_config(["--zero-stage", "2", "--offload-optimizer"])  # the boolean spelling still works
    assert old.validate(1).zero.optimizer_offload == "cpu"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    assert parse_config(["--deepspeed-config", str(ds)]).zero.offload_param_device == "cpu"  # zero.host_params
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}}}))
    run = parse_config(["--deepspeed-config", str(ds)])
    z = run.zero
    assert (z.offload_param_device, z.offload_param_nvme_path, z.offload_param_buffer_count) == ("nvme", str(tmp_path), 3)
    run.training.global_batch_size = 32
    zc = run.validate(4).zero
    assert (zc.offload_param_device, zc.offload_param_nvme_path, zc.offload_param_buffer_count) == ("nvme", str(tmp_path), 3)
    run.zero.offload_param_nvme_path = None
    with pytest.raises(ValueError, match="zero.offload_param_nvme_path"):
        run.validate(4)


# --- offload_param: the stage-3 parameter partition on disk -----------------------------------------
def _params_on_disk(path, **kw):
    return dict(_nvme(path), offload_param_device="nvme", offload_param_nvme_path=str(path),
                offload_param_buffer_count=2, **kw)


def check_params_on_disk_equal_stage3(path, prefetch):
    from zerotron.zero.infinity.disk_optimizer_state import expected_infinity_bytes
    from zerotron.zero.infinity.disk_params import expected_param_offload_bytes

    steps = 5
    base = train_gpt(dict(stage=3, stage3_prefetch_bucket_size=prefetch), steps, want_params=True)
    disk = train_gpt(_params_on_disk(path, stage3_prefetch_bucket_size=prefetch), steps, want_params=True)
    for name, value in base["params"].items():
        assert torch.equal(disk["params"][name], value), name
    psi, dp, part = disk["psi"], torch.distributed.get_world_size(), disk["part_numel"]
    mem, ref = disk["memory"], base["memory"]
    assert mem["params"] == 0 and ref["params"] == 4 * part  # the partition left memory ...
    moved = expected_param_offload_bytes(psi, dp, param_bytes=4)["memory_saved"]
    assert abs(ref["params"] - moved) <= 0.02 * moved, (ref, moved)  # ... and it is Ψ/Nd·4 bytes
    want = expected_infinity_bytes(psi, dp, param_bytes=4, offload_param=True)
    assert mem["total_model_states"] == mem["grads"]  # only the gradient partition stays
    assert abs(mem["total_model_states"] - want["device"]) <= 0.02 * want["device"], (mem, want)
    assert mem["offloaded_to_disk"] == 16 * part  # master + moments (12) and the fp32 parameter file (4)
    assert abs(mem["offloaded_to_disk"] - want["disk"]) <= 0.02 * want["disk"], (mem, want)
    io = disk["param_disk"]
    assert io["written"] == steps * 4 * part  # the updated partition written back once per step
    # read before the forward and the backward gathers; from the second step on (the first records
    # the order of use) the root unit stays gathered from forward into backward and is read once
    root_part = disk["root_numel"] // dp
    assert io["read"] >= 4 * (steps * 2 * part - (steps - 1) * root_part), (io, part, root_part)
    if prefetch == 1:  # gathers not prefetched: the next unit is read ahead from disk instead
        assert io["read_ahead_hits"] > 0
    return mem, want, io


@pytest.mark.parametrize("ranks,prefetch", [(2, 10**6), (4, 1)])
def test_params_on_disk_equal_stage3(tmp_path, ranks, prefetch):
    for mem, want, io in spawn(check_params_on_disk_equal_stage3, ranks, str(tmp_path), prefetch, timeout=100):
        print(mem, want, io)
    assert not any(tmp_path.rglob("*.f32")), "parameter and state files are removed with the optimizer"


def check_checkpoint_params_on_disk_to_plain_stage3(path):
    import torch.distributed as dist

    from zerotron.model.config import GPTConfig
    from zerotron.model.gpt import GPT
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    from tests.zero.common import HYPER
    from zerotron.testing.zero_runs import GPT_SHAPE, markov_batches

    grid = Grid(ParallelDims())
    data = list(zip(range(5), markov_batches(128, 4 * grid.dp_size, 33, seed=3)))
    sl = slice(grid.dp_rank * 4, grid.dp_rank * 4 + 4)

    def make(kw):
        model = GPT(GPTConfig(**GPT_SHAPE), grid, seed=11)
        cfg = ZeroConfig(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=10**6, **kw)
        return model, ZeroOptimizer(model, grid, cfg, clip_grad=1.0, **HYPER)

    def train(model, opt, batches):
        for _, b in batches:
            opt.backward(model(b[sl][:, :-1], labels=b[sl][:, 1:]))
            opt.step()

    ref_model, ref = make(dict(stage=3))
    train(ref_model, ref, data)
    model, opt = make(_params_on_disk(path))
    train(model, opt, data[:2])
    state = opt.partition_state()
    saved = [None] * grid.dp_size  # every rank's (index, state): the resharding pattern of a checkpoint
    dist.all_gather_object(saved, (opt.partition_index(), {k: state[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")}))
    full = {}
    for index, st in saved:
        for name, start, end, off in index:
            for key, t in st.items():
                buf = full.setdefault((name, key), torch.full((opt.param_shapes[name].numel(),), float("nan")))
                buf[start:end] = t[off:off + end - start]
    assert all(not torch.isnan(v).any() for v in full.values())
    model2, plain = make(dict(stage=3))
    plain.load_partition_state(lambda name, key, s, e: full[(name, key)][s:e], step=state["step"],
                               loss_scaler=state["loss_scaler"])
    train(model2, plain, data[2:])
    mine = dict(plain.full_params())
    for name, value in ref.full_params():
        assert torch.equal(mine[name], value), name
    # and back: the plain partition loaded into params-on-disk goes through the param file
    model3, back = make(_params_on_disk(path))
    back.load_partition_state(lambda name, key, s, e: full[(name, key)][s:e], step=state["step"],
                              loss_scaler=state["loss_scaler"])
    train(model3, back, data[2:])
    for name, value in back.full_params():
        assert torch.equal(mine[name], value), name
    return True


def test_checkpoint_with_params_on_disk_loads_into_plain_stage3(tmp_path):
    assert all(spawn(check_checkpoint_params_on_disk_to_plain_stage3, 2, str(tmp_path), timeout=100))
