"""The step-time model (zerotron.estimate.step_time) against hand-computed cases.

* The ring formula term by term: a 1 GB all-reduce over one DGX-2's 16 GPUs, its bytes recorded
  by ``CommStats`` itself (2Ψ), costs 2·15 latency steps plus (15/16)·2 GB at 150 GB/s.
* Where groups sit on the ZeRO paper's 400-GPU layout (§10.1, TP 16 × DP 25): every TP group in
  one node at NVSwitch speed, every DP group on 25 nodes at 100 GB/s shared by 16 GPUs; at TP 8
  a DP group has 2 members per node and twice that share.
* Overlap: TP never hidden, the gradient reduce-scatter hidden up to the backward window, the
  stage 1-2 all-gather never; exposed communication never exceeds the total.
* Monotonicity: more bandwidth or a higher efficiency never makes a step slower.
* Latency by hop: a ring over several nodes pays the network's latency only on the hops that
  cross a node boundary (NCCL's cost model), a chained reduce on every hop once it leaves a node.
"""

import json

import pytest

from zerotron.estimate.step_time import (GB, LinkModel, collective_time, default_overlap, group_span,
                                         model_flops_per_gpu, predict_step, ring_bandwidth)
from zerotron.model import get_preset
from zerotron.model.flops import flops_per_iteration
from zerotron.parallel.comm_stats import CommStats
from zerotron.parallel.grid import ParallelDims, layout

LINK = LinkModel()


def groups_of(rank: int, tp: int, world: int) -> dict[str, list[int]]:
    lay = layout(ParallelDims(tp=tp).resolve(world))
    return {kind: list(next(g for g in groups if rank in g)) for kind, groups in lay.items()}


def test_ring_all_reduce_term_by_term():
    stats = CommStats()
    stats.record("all_reduce", "tp", numel=500_000_000, element_size=2)  # a 1 GB fp16 tensor
    count = stats.get("all_reduce", "tp")
    assert count.bytes == 2_000_000_000  # 2Ψ, the paper's all-reduce volume

    span = group_span(range(16), LINK.gpus_per_node)
    assert (span.size, span.nodes, span.members_per_node, span.intra_node) == (16, 1, 16, True)
    latency, bandwidth = collective_time("all_reduce", count.calls, count.bytes, span, LINK)
    assert latency == pytest.approx(2 * 15 * 5e-6)  # 2(n-1) steps of 5 us
    assert bandwidth == pytest.approx(15 / 16 * 2e9 / 150e9)  # (n-1)/n of 2Ψ at 150 GB/s = 12.5 ms

    st = predict_step(0.0, {"all_reduce/tp": vars(count)}, {"tp": list(range(16))}, LINK)
    assert st.comm_s["tp"] == pytest.approx(0.0125 + 150e-6)
    assert st.step_s == pytest.approx(st.comm_s["tp"]) and st.compute_s == 0.0


def test_reduce_scatter_all_gather_and_p2p_terms():
    span = group_span(range(16), 16)
    lat, bw = collective_time("reduce_scatter", 2, 1e9, span, LINK)
    assert lat == pytest.approx(2 * 15 * 5e-6) and bw == pytest.approx(15 / 16 * 1e9 / 150e9)
    assert collective_time("all_gather", 2, 1e9, span, LINK) == (lat, bw)
    pp = group_span([0, 16], 16)  # two stages on two nodes, every GPU of each node sending at once
    lat, bw = collective_time("send", 4, 1e9, pp, LINK)
    assert lat == pytest.approx(4 * 10e-6) and bw == pytest.approx(1e9 / (100e9 / 16))
    assert collective_time("all_reduce", 3, 1e9, group_span([5], 16), LINK) == (0.0, 0.0)
    # 1F1B exchanges both ways at once: the slower direction counts, not the sum
    both = predict_step(0.0, {"send/pp": {"calls": 4, "bytes": 1e9}, "recv/pp": {"calls": 4, "bytes": 1e9}},
                        {"pp": [0, 16]}, LINK)
    totals = predict_step(0.0, {"pp": {"calls": 8, "bytes": 2e9}}, {"pp": [0, 16]}, LINK)
    assert both.comm_s["pp"] == pytest.approx(lat + bw) == pytest.approx(totals.comm_s["pp"])


def test_paper_layout_tp_intra_dp_inter():
    world, tp, dp = 400, 16, 25
    lay = layout(ParallelDims(tp=tp).resolve(world))
    for ranks in lay["tp"]:
        span = group_span(ranks, 16)
        assert span.intra_node and span.size == 16
        assert ring_bandwidth(span, LINK) == 150 * GB
    for ranks in lay["dp"]:
        span = group_span(ranks, 16)
        assert (span.size, span.nodes, span.members_per_node) == (dp, 25, 1)
        assert ring_bandwidth(span, LINK) == pytest.approx(100 * GB / 16)  # 6.25 GB/s per GPU
    assert group_span(lay["world"][0], 16).nodes == 25

    psi_bytes = 6.33e9 * 2  # the fp16 gradient of one MP rank's 100B slice, reduce-scattered once
    st = predict_step(0.0, {"reduce_scatter/dp": {"calls": 1, "bytes": psi_bytes}}, groups_of(37, tp, world))
    assert st.detail["dp"]["nodes"] == 25
    assert st.comm_s["dp"] == pytest.approx(24 * 10e-6 + 24 / 25 * psi_bytes / 6.25e9)

    lay8 = layout(ParallelDims(tp=8).resolve(world))  # two DP members per node: half the groups per NIC
    span8 = group_span(lay8["dp"][3], 16)
    assert (span8.size, span8.nodes, span8.members_per_node) == (50, 25, 2)
    assert ring_bandwidth(span8, LINK) == pytest.approx(2 * 100 * GB / 16)
    assert ring_bandwidth(span8, LINK, concurrent=1) == 150 * GB  # 200 GB/s of NIC share, NVSwitch caps it


def _comm_100b():
    return {"all_reduce/tp": {"calls": 750, "bytes": 805e9},
            "reduce_scatter/dp": {"calls": 30, "bytes": 12.67e9},
            "all_gather/dp": {"calls": 30, "bytes": 12.67e9}}


def test_overlap_rules():
    ranks = groups_of(0, 16, 400)
    flops = 1.69e15
    plain = predict_step(flops, _comm_100b(), ranks, overlap=default_overlap(False, 2))
    assert plain.exposed_comm_s == pytest.approx(plain.total_comm_s)
    st = predict_step(flops, _comm_100b(), ranks, overlap=default_overlap(True, 2))
    assert st.exposed_s["tp"] == st.comm_s["tp"] > 0  # Megatron's all-reduces are on the critical path
    rs = sum(collective_time("reduce_scatter", 30, 12.67e9, group_span(ranks["dp"], 16), LINK))
    assert st.exposed_s["dp"] == pytest.approx(st.comm_s["dp"] - rs)  # the all-gather stays exposed
    assert 0 <= st.exposed_comm_s <= st.total_comm_s
    assert st.step_s == pytest.approx(st.compute_s + st.exposed_comm_s) and st.step_s < plain.step_s

    tiny = predict_step(1e12, _comm_100b(), ranks, overlap=default_overlap(True, 2), overlap_window=0.75)
    assert tiny.total_comm_s - tiny.exposed_comm_s == pytest.approx(0.75 * tiny.compute_s)  # capped

    for stage in (0, 1, 2, 3):
        rules = default_overlap(False, stage)
        assert rules["tp"] == rules["pp"] == 0.0 and rules.get("reduce_scatter/dp", 0.0) == 0.0
    assert default_overlap(True, 0)["all_reduce/dp"] == 1.0
    assert default_overlap(True, 2)["all_gather/dp"] == 0.0 and default_overlap(False, 3)["all_gather/dp"] == 1.0
    assert default_overlap(True, 1)["dp"] == 0.5  # totals: the reduce-scatter's Ψ of 2Ψ
    with pytest.raises(ValueError, match="stage"):
        default_overlap(True, 4)


def test_more_bandwidth_or_efficiency_is_never_slower():
    ranks = groups_of(0, 16, 400)
    steps = [predict_step(1.69e15, _comm_100b(), ranks, LinkModel(inter_node_gbps=g)).step_s
             for g in (25, 50, 100, 200, 400)]
    assert all(a > b for a, b in zip(steps, steps[1:]))
    steps = [predict_step(1.69e15, _comm_100b(), ranks, LinkModel(intra_node_gbps=g)).step_s for g in (50, 150, 300)]
    assert all(a > b for a, b in zip(steps, steps[1:]))
    tf = [predict_step(1.69e15, _comm_100b(), ranks, efficiency=e).tflops_per_gpu for e in (0.3, 0.4, 0.5)]
    assert all(a < b for a, b in zip(tf, tf[1:]))
    slow = predict_step(1.69e15, _comm_100b(), ranks, LinkModel(inter_latency_us=1000.0)).step_s
    assert slow > predict_step(1.69e15, _comm_100b(), ranks).step_s


def test_flops_tflops_and_output():
    cfg = get_preset("zero-100b")
    fl = model_flops_per_gpu(cfg, 800, 400, recompute=True, tp=16)
    assert fl == pytest.approx(flops_per_iteration(cfg, 800, None, True, 16) / 400)
    st = predict_step(fl, _comm_100b(), groups_of(0, 16, 400), overlap=default_overlap(True, 2))
    assert st.compute_s == pytest.approx(fl / (125e12 * 0.5))
    assert st.tflops_per_gpu == pytest.approx(fl / st.step_s / 1e12)
    assert 0 < st.tflops_per_gpu < 0.5 * 125
    json.dumps(st.as_dict())
    rows = st.rows()
    assert rows[0][0] == "term" and [r[0] for r in rows[1:]] == ["compute", "dp", "tp", "step"]


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="group_ranks"):
        predict_step(1.0, {"all_reduce/tp": {"calls": 1, "bytes": 1}}, {"dp": [0, 1]})
    with pytest.raises(ValueError, match="twice"):
        predict_step(1.0, {"tp": {"calls": 1, "bytes": 1}, "all_reduce/tp": {"calls": 1, "bytes": 1}}, {"tp": [0, 1]})
    with pytest.raises(ValueError, match="efficiency"):
        predict_step(1.0, {}, {}, efficiency=0.0)
    with pytest.raises(ValueError, match="overlap"):
        predict_step(1.0, {"tp": {"calls": 1, "bytes": 1}}, {"tp": [0, 1]}, overlap={"tp": 2.0})
    with pytest.raises(ValueError, match="inter_node_gbps"):
        LinkModel(inter_node_gbps=0)


def test_ring_latency_counts_each_hop_on_its_link():
    """Baseline-170B's TP ring, 256 GPUs over 16 DGX-2s: a pass is 255 hops, 15 of them between
    nodes (10 us) and 240 on NVSwitch (5 us); an all-reduce makes two passes."""
    tp = group_span(range(256), 16)
    assert (tp.nodes, tp.members_per_node) == (16, 16)
    lat, _ = collective_time("all_reduce", 3, 1e6, tp, LINK)
    assert lat == pytest.approx(3 * 2 * (15 * 10e-6 + 240 * 5e-6))
    lat, _ = collective_time("reduce_scatter", 1, 1e6, tp, LINK)
    assert lat == pytest.approx(15 * 10e-6 + 240 * 5e-6)
    # one member per node: every hop crosses nodes; one node: every hop on NVSwitch
    assert collective_time("all_gather", 1, 1e6, group_span(range(0, 400, 16), 16), LINK)[0] == \
        pytest.approx(24 * 10e-6)
    assert collective_time("all_gather", 1, 1e6, group_span(range(16), 16), LINK)[0] == \
        pytest.approx(15 * 5e-6)
    # a chained reduce spanning nodes: NCCL times every hop at the network's latency
    assert collective_time("reduce", 1, 1e6, tp, LINK)[0] == pytest.approx(255 * 10e-6)
