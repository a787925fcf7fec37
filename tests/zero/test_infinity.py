"""ZeRO-Infinity (arXiv 2104.07857): stage 3 with the optimizer state on local disk.

* fp32 parameters after 5 steps equal stage 3 without offload exactly (tiles of 1000 elements,
  buffer_count 2, so the read-ahead / write-behind bound is exercised), and so do the moments;
* the model states in (process) memory drop to params + grads as ``expected_infinity_bytes``
  predicts, master and moments are reported under ``offloaded_to_disk``;
* a checkpoint round trip (partition_state -> load_partition_state) through the disk state;
* config: DeepSpeed nested dicts, errors naming the key, ``offload_param`` refused, trainer config.
"""

import json

import pytest
import torch

from tests.harness import spawn
from tests.zero.zeropp_common import train_gpt


def _nvme(path, **kw):
    return dict(stage=3, offload_optimizer_device="nvme", offload_optimizer_nvme_path=str(path), sub_group_size=1000,
                offload_optimizer_buffer_count=2, **kw)


def check_nvme_equals_stage3(path):
    from zerotron.zero.nvme_optimizer import expected_infinity_bytes

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
    from tests.zero.zeropp_common import GPT_SHAPE

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
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param.device='nvme'.*not implemented"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "zero.offload_optimizer_device"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "zero.offload_optimizer_nvme_path"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 1}},
     "zero.offload_optimizer_buffer_count"),
    ({"stage": 3, "offload_optimizer": {"device": "disk"}}, "offload_optimizer.device='disk'"),
    ({"stage": 3, "sub_group_size": 0}, "zero.sub_group_size"),
])
def test_config_errors_name_the_key(zero, match):
    from zerotron.zero import ZeroConfig

    with pytest.raises(ValueError, match=match):
        ZeroConfig.from_deepspeed(zero)


def test_deepspeed_nested_offload_dict(tmp_path):
    from zerotron.training.cli import parse_config
    from zerotron.training.setup_run import zero_config
    from zerotron.zero import ZeroConfig

    zero = {"stage": 3, "sub_group_size": 1e6, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5},
            "offload_param": {"device": "none"}}
    cfg = ZeroConfig.from_deepspeed(zero)
    assert (cfg.optimizer_offload, cfg.offload_optimizer_nvme_path, cfg.offload_optimizer_buffer_count,
            cfg.sub_group_size) == ("nvme", str(tmp_path), 5, 1_000_000)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": zero}))
    run = parse_config(["--deepspeed-config", str(ds)])
    z = run.zero
    assert (z.offload_optimizer, z.offload_optimizer_device, z.nvme_path, z.buffer_count) == (True, "nvme", str(tmp_path), 5)
    assert (z.sub_group_size, z.zero_hpz_partition_size, z.zero_quantized_weights) == (1_000_000, 2, True)
    run.training.global_batch_size = 32
    run.validate(4)
    zc = zero_config(run)
    assert zc.optimizer_offload == "nvme" and zc.zero_hpz_partition_size == 2
    run.zero.zero_hpz_partition_size = 3
    with pytest.raises(ValueError, match="zero.zero_hpz_partition_size=3"):
        zero_config(run)
    old = parse_config(["--zero-stage", "2", "--offload-optimizer"])  # the boolean spelling still works
    assert zero_config(old.validate(1)).optimizer_offload == "cpu"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    with pytest.raises(ValueError, match="offload_param"):
        parse_config(["--deepspeed-config", str(ds)])
