"""ZeRO++ (arXiv 2306.10209) on gloo ranks, tiny GPT, fp32: bytes from the counted collectives,
exactness or loss against the unquantized stage.

* qwZ: stage-3 parameter all-gather bytes <= 0.53x unquantized; loss within 2% of plain stage 3.
* hpZ (8 ranks, secondary group 4): backward gathers only on "dp_inner", forward ones on "dp";
  parameters after 5 steps equal plain stage 3 exactly; the secondary partition is reported.
* qgZ (4 ranks, node size 2, hierarchical): gradient reduce bytes <= 0.3x fp32; loss within 2% of
  stage 2.
qgZ runs the issue's 200 steps; qwZ runs QWZ_STEPS = 100 to stay under 60 s on a 2-core machine
(its quantize/dequantize per gather is slower on CPU): ``scripts/bench/zeropp.py --steps 200`` runs
the full length for both.
"""

import pytest

from tests.harness import spawn
from zerotron.testing.zero_runs import comm_bytes, tail_loss, train_gpt

QWZ_STEPS, QGZ_STEPS = 100, 200


def _run(configs, steps, want_params=False):
    return [train_gpt(kw, steps, want_params=want_params) for kw in configs]


def test_qwz_halves_gather_bytes_and_keeps_loss():
    base, q = spawn(_run, 4, [dict(stage=3), dict(stage=3, zero_quantized_weights=True)], QWZ_STEPS, timeout=150)[0]
    ratio = comm_bytes(q["comm"], "all_gather", ("dp",)) / comm_bytes(base["comm"], "all_gather", ("dp",))
    gap = abs(tail_loss(q["losses"]) - tail_loss(base["losses"])) / tail_loss(base["losses"])
    print(f"qwZ all-gather bytes ratio {ratio:.4f}, loss gap {gap:.4%} after {QWZ_STEPS} steps")
    assert ratio <= 0.53, ratio
    assert gap <= 0.02, (tail_loss(q["losses"]), tail_loss(base["losses"]))
    assert tail_loss(q["losses"]) < q["losses"][0] - 1.0  # it did learn


def test_hpz_backward_gathers_stay_in_the_secondary_group():
    base, h = spawn(_run, 8, [dict(stage=3), dict(stage=3, zero_hpz_partition_size=4)], 5, True, timeout=150)[0]
    for name, value in base["params"].items():
        assert (h["params"][name] - value).abs().max().item() == 0.0, name
    comm, full = h["comm"], h["full_numel"]
    assert set(k for k in comm if k.startswith("all_gather")) == {"all_gather/dp", "all_gather/dp_inner"}, comm
    assert comm["all_gather/dp"]["elements"] == full  # forward: one gather of every unit over DP
    # backward: the same volume inside the node, less the root unit (still gathered from forward)
    assert comm["all_gather/dp_inner"]["elements"] == full - h["root_numel"]
    assert base["comm"]["all_gather/dp"]["elements"] == 2 * full - base["root_numel"]
    mem = h["memory"]
    assert mem["secondary_params"] == full // 4 * 4  # 1/k of the parameters, fp32
    assert mem["total_model_states"] == base["memory"]["total_model_states"] + mem["secondary_params"]


def test_qgz_reduce_bytes_and_loss():
    cfgs = [dict(stage=2), dict(stage=2, zero_quantized_gradients=True, zero_quantized_gradients_node_size=2)]
    base, q = spawn(_run, 4, cfgs, QGZ_STEPS, timeout=150)[0]
    fp32 = comm_bytes(base["comm"], "reduce_scatter", ("dp",))
    moved = comm_bytes(q["comm"], "all_to_all")
    assert comm_bytes(q["comm"], "reduce_scatter") == 0
    assert {k for k in q["comm"] if k.startswith("all_to_all")} == {"all_to_all/dp_inner", "all_to_all/dp_outer"}
    gap = abs(tail_loss(q["losses"]) - tail_loss(base["losses"])) / tail_loss(base["losses"])
    print(f"qgZ reduce bytes ratio {moved / fp32:.4f}, loss gap {gap:.4%} after {QGZ_STEPS} steps")
    assert moved / fp32 <= 0.3, moved / fp32
    assert gap <= 0.02, (tail_loss(q["losses"]), tail_loss(base["losses"]))


def test_qgz_stage3_with_qwz_and_hpz_trains():
    cfg = dict(stage=3, zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=2)
    (r,) = spawn(_run, 4, [cfg], 20, timeout=100)[0]
    assert r["losses"][-1] < r["losses"][0] - 0.5
    assert "all_gather/dp_inner" in r["comm"] and "all_to_all/dp_inner" in r["comm"]


@pytest.mark.parametrize("kw,dp,match", [
    (dict(stage=2, zero_quantized_weights=True), None, "zero.zero_quantized_weights"),
    (dict(stage=2, zero_hpz_partition_size=2), None, "zero.zero_hpz_partition_size"),
    (dict(stage=3, zero_hpz_partition_size=3), 8, "zero.zero_hpz_partition_size=3.*divide"),
    (dict(stage=3, zero_quantized_gradients=True, zero_quantized_gradients_node_size=3), 4,
     "zero.zero_quantized_gradients_node_size"),
    (dict(stage=0, zero_quantized_gradients=True), None, "zero.zero_quantized_gradients"),
    (dict(stage=3, zero_quantization_block_size=0), None, "zero.zero_quantization_block_size"),
])
def test_validation_names_the_key(kw, dp, match):
    from zerotron.zero import ZeroConfig

    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kw).validate(dp_size=dp)


def test_from_deepspeed_reads_zeropp_keys():
    from zerotron.config.deepspeed import from_deepspeed

    cfg = from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 8}})[0].zero
    assert (cfg.zero_quantized_weights, cfg.zero_quantized_gradients, cfg.zero_hpz_partition_size) == (True, True, 8)


def _hpz_run(tp: int, hpz: int, qgz_node: int = 0):
    from zerotron.config.run_config import RunConfig

    cfg = RunConfig()
    cfg.parallel.tp, cfg.zero.stage, cfg.zero.zero_hpz_partition_size = tp, 3, hpz
    cfg.zero.zero_quantized_gradients = bool(qgz_node)
    cfg.zero.zero_quantized_gradients_node_size = qgz_node
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, 64
    return cfg


def test_node_local_groups_that_would_cross_nodes_are_refused(monkeypatch):
    """4 DGX nodes x 8 GPUs, tp 2: DP members are 2 ranks apart (Megatron's order: TP fastest), so
    a node holds 4 of each DP group and an hpZ (or qgZ) group of 8 would span two nodes -- its
    "node-local" backward gathers would cross the slow link. Nodes worked out by hand: ranks
    0, 2, ..., 14 are on nodes 0 (0-7) and 1 (8-15)."""
    from zerotron.config.run_config import ConfigError

    want = (r"zero_hpz_partition_size=8: .*\[0, 2, 4, 6, 8, 10, 12, 14\] spans nodes \[0, 1\] "
            r"of 8 GPUs.*use 4")
    with pytest.raises(ConfigError, match=want):
        _hpz_run(tp=2, hpz=8).validate(32, gpus_per_node=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's: the default when not given
    with pytest.raises(ConfigError, match="zero_quantized_gradients_node_size=8: .* spans nodes"):
        _hpz_run(tp=2, hpz=1, qgz_node=8).validate(32)
    _hpz_run(tp=2, hpz=4, qgz_node=4).validate(32)  # 4 members x tp 2 = one node
    _hpz_run(tp=1, hpz=8, qgz_node=8).validate(32)  # no TP: 8 consecutive ranks
