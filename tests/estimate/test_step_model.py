"""The step-time model (zerotron.estimate.step_model) term by term, each against its own count.

* A GEMM's FLOPs and bytes by hand, and the roofline turning bandwidth-bound for a thin one.
* One layer's GEMMs at TP 2 add up to T·(8h² + 4hf) per token (Megatron-LM's count, by hand).
* A DP all-reduce on a ring over two nodes: 2(n − 1) latency steps plus (n − 1)/n of the
  recorded 2Ψ over the node's InfiniBand share, computed here from the link figures.
* The 1F1B bubble is (p − 1)/(m + p − 1) of the pipelined time.
* The collectives counted from the config equal what a dry run of the real step records
  (TP 2 × PP 2 × DP 2, last rank, Pa, stage 2), scalar reductions (norm, overflow) aside.
* The V100 preset's one tuned constant gives Megatron-LM's one-GPU 1.2B run 30 % of peak.
"""

import pytest
import torch

from zerotron.estimate import kernels, step_model
from zerotron.estimate.comm_volumes import analytic_comm
from zerotron.estimate.hardware import H100_DGX, V100_DGX2, get_hardware
from zerotron.model.config import GPTConfig
from zerotron.config.run_config import RunConfig

TINY = GPTConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=1024, seq_length=128)


def run_config(tp=1, pp=1, dp=1, micro=2, batch=2, stage=0, recompute=False) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = tp, pp, dp
    cfg.training.micro_batch_size, cfg.training.global_batch_size = micro, batch
    cfg.training.precision = "fp16"
    cfg.zero.stage = stage
    cfg.activation_checkpointing.checkpoint_activations = recompute
    return cfg


def test_gemm_flops_bytes_and_roofline_by_hand():
    g = kernels.Gemm("x", m=4, n=6, k=8)
    assert g.flops == 2 * 4 * 6 * 8  # 384
    assert g.bytes(2) == 2 * (4 * 8 + 8 * 6 + 4 * 6)  # 208: A read, B read, C written
    dgrad, wgrad = g.backward()
    assert (dgrad.m, dgrad.n, dgrad.k) == (4, 8, 6) and (wgrad.m, wgrad.n, wgrad.k) == (8, 6, 4)
    assert dgrad.flops == wgrad.flops == g.flops
    # a square 8192 GEMM is compute-bound on a V100: 2·8192³ FLOPs at 125e12 × 0.5
    big = kernels.Gemm("big", 8192, 8192, 8192)
    assert kernels.gemm_seconds(big, 125e12, 0.5, 900e9, 2) == pytest.approx(2 * 8192**3 / 62.5e12)
    # one with k = 16 is bandwidth-bound: 2·(8192·16·2 + 8192²) bytes at 900 GB/s
    thin = kernels.Gemm("thin", 8192, 8192, 16)
    want = 2 * (8192 * 16 * 2 + 8192 * 8192) / 900e9
    assert kernels.gemm_seconds(thin, 125e12, 0.5, 900e9, 2) == pytest.approx(want)
    assert want > thin.flops / 62.5e12


def test_wave_quantization_counts_whole_tiles_and_waves_by_hand():
    """NVIDIA's tile and wave quantization, counted by hand for 256 x 128 tiles."""
    # 1024 x 1536 on a V100's 80 SMs: 4 x 12 = 48 tiles (or 8 x 6), one wave of 80 tiles
    g = kernels.Gemm("proj", 1024, 1536, 1536)
    assert kernels.wave_quantization(g, 80) == pytest.approx(80 * 256 * 128 / (1024 * 1536))
    assert kernels.wave_quantization(kernels.Gemm("full", 2048, 1280, 64), 80) == 1.0  # 8 x 10
    # 81 tiles of 256 x 128 need a second wave: 160 tiles' time for 81 tiles' work; as 128 x 256
    # it would be 162 tiles, three waves, so the better orientation is taken
    assert kernels.wave_quantization(kernels.Gemm("w", 81 * 256, 128, 64), 80) == 160 / 81
    # 128 x 2560 on one SM: 20 tiles of 256 x 128 half empty, or 10 full ones of 128 x 256
    assert kernels.wave_quantization(kernels.Gemm("o", 128, 2560, 64), 1) == 1.0
    assert kernels.wave_quantization(g, 0) == 1.0  # off
    # the roofline's compute side pays for the padding: 5/3 of 2·1024·1536² at 62.5 TFLOP/s
    want = 2 * 1024 * 1536 * 1536 / 62.5e12 * 5 / 3
    assert kernels.gemm_seconds(g, 125e12, 0.5, 900e9, 2, sm_count=80) == pytest.approx(want)


def test_layer_gemms_add_up_to_megatron_count():
    tokens, tp, h = 256, 2, TINY.hidden_size
    total = sum(g.flops for g in kernels.layer_gemms(TINY, tokens, tp))
    assert total == 2 * tokens * (3 * h * h + h * h + 4 * h * h + 4 * h * h) / tp  # 2T(12h²)/t
    assert total == tokens * (8 * h * h + 4 * h * TINY.ffn_size) / tp
    attn = sum(g.flops for g in kernels.attention_gemms(TINY, 2, 128, tp))
    assert attn == 4 * (2 * 128) * 128 * h / tp  # 4·T·s·h over TP


def test_elementwise_bytes_by_hand():
    """Per token and layer: 2 LayerNorms (2h each), 2 residual dropouts (2h), 2 residual adds
    (3h), 2 row-parallel bias adds after the all-reduce (2h), all unsplit by TP; GeLU 2f/t."""
    import dataclasses

    tokens, tp, h, f = 256, 2, TINY.hidden_size, TINY.ffn_size
    want = tokens * (4 * h + 4 * h + 6 * h + 4 * h) + tokens * 2 * f // tp
    assert kernels.layer_elementwise_elements(TINY, tokens, tp) == want
    # no biases (Llama): no bias adds; sequence parallelism splits the h terms over TP
    plain = dataclasses.replace(TINY, add_bias_linear=False)
    assert kernels.layer_elementwise_elements(plain, tokens, tp) == want - tokens * 4 * h
    split = kernels.layer_elementwise_elements(TINY, tokens, tp, sequence_parallel=True)
    assert split == tokens // tp * 18 * h + tokens * 2 * f // tp


def test_dp_all_reduce_on_a_two_node_ring():
    # 4 GPUs, 2 per node, DP 4 at stage 0: one ring of 4 over 2 nodes, 2 members on each
    hw = V100_DGX2.with_overrides(gpus_per_node=2, inter_node_gbps=10.0, intra_node_gbps=100.0,
                                  inter_latency_us=20.0, intra_latency_us=3.0,
                                  grad_dtype="accumulate")  # zerotron's fp32 gradients
    cfg = run_config(dp=4, batch=8, stage=0)
    cfg.zero.reduce_bucket_size = 0  # one bucket: one call
    comm = analytic_comm(cfg, TINY)
    psi = TINY.num_params() + 2 * TINY.hidden_size  # every parameter, the final LayerNorm included
    assert comm["all_reduce/dp"] == {"calls": 1, "bytes": 2 * psi * 4}  # 2Ψ of fp32 gradients
    pred = step_model.predict(cfg, TINY, 4, hw)
    n, nbytes = 4, 2 * psi * 4
    bandwidth = min(100e9, 2 * 10e9 / 2)  # 2 members share the node's 10 GB/s with its 2 GPUs
    # 2 passes of 3 hops: a pass crosses the node boundary once (20 us) and stays on the node's
    # NVLink twice (3 us each), as NCCL's cost model counts a ring's hops
    want = 2 * (1 * 20e-6 + 2 * 3e-6) + (n - 1) / n * nbytes / bandwidth
    assert pred.comm_s["dp"] == pytest.approx(want, rel=1e-12)
    assert pred.exposed_s["dp"] == pytest.approx(want, rel=1e-12)  # overlap_comm off: none hidden


def test_recompute_runs_the_forward_once_more():
    plain = step_model.predict(run_config(), TINY, 1, V100_DGX2)
    full = step_model.predict(run_config(recompute=True), TINY, 1, V100_DGX2)
    cfg = run_config()
    cfg.activation_checkpointing.recompute_granularity = "selective"
    selective = step_model.predict(cfg, TINY, 1, V100_DGX2)
    # forward 1 unit, backward 2: full adds one unit of every layer kernel, selective of attention
    assert full.attention_s == pytest.approx(plain.attention_s * 4 / 3, rel=1e-12)
    assert full.elementwise_s > plain.elementwise_s and full.gemm_s > plain.gemm_s
    assert selective.attention_s == pytest.approx(plain.attention_s * 4 / 3, rel=1e-12)
    assert (selective.gemm_s, selective.elementwise_s) == (plain.gemm_s, plain.elementwise_s)


@pytest.mark.parametrize("pp,micro,virtual", [(2, 4, 1), (4, 8, 1), (4, 8, 2)])
def test_pipeline_bubble(pp, micro, virtual):
    assert step_model.bubble_fraction(pp, micro) == pytest.approx((pp - 1) / (micro + pp - 1))
    cfg = run_config(pp=pp, batch=micro * 2)
    cfg.parallel.virtual_stages = virtual
    pred = step_model.predict(cfg, TINY, pp, V100_DGX2)
    share = pred.bubble_s / (pred.bubble_s + pred.compute_s)
    assert share == pytest.approx((pp - 1) / virtual / (micro + (pp - 1) / virtual), rel=1e-12)


def test_counted_collectives_equal_a_dry_run():
    from zerotron.config.cli import parse_config
    from zerotron.training.dry_run import simulate_rank
    from zerotron.training.setup_run import validate_model

    torch.set_num_threads(1)
    args = ["--config", "configs/tiny.yaml", "--parallel.tp", "2", "--parallel.pp", "2",
            "--zero.stage", "2", "--training.precision", "bf16", "--model.vocab_size", "1024",
            "--activation_checkpointing.checkpoint_activations", "true",
            "--activation_checkpointing.partition_activations", "true"]
    cfg = parse_config(args, world_size=8)
    cfg.validate(8)
    mcfg = validate_model(cfg)
    measured = simulate_rank(cfg, mcfg, 8, 7, device_kind="cpu").comm_ops
    counted = analytic_comm(cfg, mcfg)
    big = {k: {"calls": v["calls"], "bytes": v["bytes"]}
           for k, v in measured.items() if v["bytes"] > 64}  # scalars: norm, overflow, loss
    assert counted == big


def test_v100_constant_reproduces_megatron_one_gpu_baseline():
    cfg = run_config(micro=8, batch=8, recompute=True)
    mcfg = GPTConfig(num_layers=40, hidden_size=1536, num_heads=16, vocab_size=50257,
                     seq_length=1024, dropout=0.1, attention_dropout=0.1)
    pred = step_model.predict(cfg, mcfg, 1, V100_DGX2)
    assert pred.tflops_per_gpu / 125 == pytest.approx(0.30, abs=0.005)  # Megatron-LM §5: 30 %
    assert pred.step_s == pytest.approx(pred.compute_s + pred.optimizer_s)  # one GPU: nothing else


def test_hardware_presets_and_bad_values():
    assert get_hardware("H100") is H100_DGX and H100_DGX.peak("bf16") == 989e12
    assert H100_DGX.memory_gb == 80 and V100_DGX2.memory_gb == 32
    with pytest.raises(ValueError, match="--gpu 'a100'"):
        get_hardware("a100")
    assert V100_DGX2.peak("bf16") == V100_DGX2.peak("fp16") == 125e12  # no bf16 on Volta
    with pytest.raises(ValueError, match="no dense float8"):
        V100_DGX2.peak("float8")
    with pytest.raises(ValueError, match="gemm_efficiency=1.5"):
        V100_DGX2.with_overrides(gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="sm_count=-1"):
        V100_DGX2.with_overrides(sm_count=-1)
    assert (V100_DGX2.sm_count, H100_DGX.sm_count) == (80, 132)  # V100 SXM2/3, H100 SXM5


def test_h100_constant_reproduces_megatron_175b_on_96_gpus():
    """The H100 calibration, on the layout ``scripts/bench/step_time_table.py`` assumes."""
    cfg = run_config(tp=4, pp=8, dp=3, micro=1, batch=1152, stage=1)
    cfg.parallel.virtual_stages, cfg.parallel.sequence_parallel = 6, True
    cfg.training.precision, cfg.zero.overlap_comm = "bf16", True
    gpt = GPTConfig(num_layers=96, hidden_size=12288, num_heads=96, vocab_size=50257,
                    seq_length=2048)
    overlap = {"reduce_scatter/dp": 1.0, "all_gather/dp": 1.0}
    pred = step_model.predict(cfg, gpt, 96, H100_DGX, overlap=overlap)
    assert pred.mfu == pytest.approx(0.47, abs=0.005)  # Megatron-core README


@pytest.mark.parametrize("preset", ["tiny-llama", "llama3.1-8b", "qwen2.5-7b"])
def test_llama_block_gemms_and_params_are_the_model_counts(preset):
    """GQA's smaller K/V and SwiGLU's gate GEMM: the step model's layer GEMMs equal the FLOP count
    held to FlopCounterMode (model/flops.py), its per-rank parameters the memory model's (held to
    the built model), untied output layer and RMSNorm included."""
    from zerotron.estimate.comm_volumes import rank_params
    from zerotron.estimate.memory_model import params_per_rank
    from zerotron.model.flops import layer_forward_flops
    from zerotron.model.presets import get_preset

    cfg = get_preset(preset)
    tokens, seq = 2 * cfg.seq_length, cfg.seq_length
    gemms = kernels.layer_gemms(cfg, tokens, 1) + kernels.attention_gemms(cfg, 2, seq, 1)
    assert sum(g.flops for g in gemms) == layer_forward_flops(cfg, tokens, seq)
    assert rank_params(cfg, tp=1, pp=1) == params_per_rank(cfg, 1)


def test_per_rank_reduces_on_a_two_node_chain():
    """DeepSpeed's stage 2 as the paper ran it: b + n − 1 chained reduces (n − 1 latency steps
    each, every byte once over each link) in place of b reduce-scatters; counted here by hand."""
    hw = V100_DGX2.with_overrides(gpus_per_node=2, inter_node_gbps=10.0, intra_node_gbps=100.0,
                                  inter_latency_us=20.0, intra_latency_us=3.0,
                                  grad_dtype="accumulate")  # the bytes as counted
    cfg = run_config(dp=4, batch=8, stage=2)
    cfg.zero.reduce_bucket_size = 0  # one bucket: b = 1
    comm = analytic_comm(cfg, TINY)
    nbytes = comm["reduce_scatter/dp"]["bytes"]
    deepspeed = step_model.predict(cfg, TINY, 4, hw)
    ours = step_model.predict(cfg, TINY, 4, hw.with_overrides(grad_reduce="reduce_scatter"))
    n, bandwidth = 4, min(100e9, 2 * 10e9 / 2)
    gather = ours.comm_s["dp"] - (20e-6 + 2 * 3e-6 + (n - 1) / n * nbytes / bandwidth)  # a ring
    # 4 reduces of 3 hops, each at the network's latency once the chain leaves the node (NCCL's
    # model of a chained reduce); every byte over each link
    want = (1 + n - 1) * (n - 1) * 20e-6 + nbytes / bandwidth
    assert deepspeed.comm_s["dp"] - gather == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="grad_reduce='ring'"):
        hw.with_overrides(grad_reduce="ring")


@pytest.mark.parametrize("stage,key", [(0, "all_reduce/dp"), (2, "reduce_scatter/dp")])
def test_the_paper_stacks_send_fp16_gradients(stage, key):
    """The V100 preset times the gradients in the fp16 the paper's stacks sent: half the bytes
    zerotron's fp32 accumulation sends, counted by hand; parameters and activations unchanged."""
    from zerotron.estimate.comm_volumes import rank_params

    cfg = run_config(tp=2, dp=4, micro=2, batch=8, stage=stage)
    comm = analytic_comm(cfg, TINY)
    sent = step_model.model_dtype_gradients(comm, cfg)
    ring = 2 if stage == 0 else 1  # an all-reduce's bytes count both of its passes
    assert comm[key]["bytes"] == ring * rank_params(TINY, 2, 1) * 4  # fp32 accumulation
    assert sent[key] == {"calls": comm[key]["calls"], "bytes": ring * rank_params(TINY, 2, 1) * 2}
    others = {k: v for k, v in comm.items() if k != key}
    assert {k: v for k, v in sent.items() if k != key} == others
    ours = step_model.predict(cfg, TINY, 8, V100_DGX2.with_overrides(grad_dtype="accumulate"))
    paper = step_model.predict(cfg, TINY, 8, V100_DGX2)
    assert paper.comm_s["dp"] < ours.comm_s["dp"] and paper.comm_s["tp"] == ours.comm_s["tp"]
    cfg.training.precision = "fp32"  # nothing narrower to send
    fp32 = analytic_comm(cfg, TINY)
    assert step_model.model_dtype_gradients(fp32, cfg) == fp32
    with pytest.raises(ValueError, match="grad_dtype='bf16'"):
        V100_DGX2.with_overrides(grad_dtype="bf16")
