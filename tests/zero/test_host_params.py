"""``offload_param: {device: cpu}`` (``zero.host_params``): the stage-3 parameter partition in host
memory. Five steps equal plain stage 3 bit for bit (the shard a gather reads is the same values,
only from the host), and the partition is reported on the host (``offloaded_to_host``), not on the
device. On this CPU-only machine host and device are the same memory; the accounting still says
where the partition lives, which is what a GPU run saves."""

import torch

from tests.harness import spawn
from zerotron.testing.zero_runs import train_gpt


def check_host_params_equal_stage3():
    steps = 5
    base = train_gpt(dict(stage=3, stage3_prefetch_bucket_size=10**6), steps, want_params=True)
    host = train_gpt(dict(stage=3, stage3_prefetch_bucket_size=10**6, offload_param_device="cpu"), steps,
                     want_params=True)
    for name, value in base["params"].items():
        assert torch.equal(host["params"][name], value), name
    part = host["part_numel"]
    assert base["memory"]["offloaded_to_host"] == 0
    assert host["memory"]["offloaded_to_host"] == 4 * part  # the fp32 parameter partition (fp32 run)
    return host["memory"]


def test_host_params_equal_stage3():
    spawn(check_host_params_equal_stage3, 2, timeout=100)
