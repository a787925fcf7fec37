"""DeepSpeed configs as people have them (tests/training/deepspeed_configs/: the key sets of the
Hugging Face transformers ZeRO-2/3 configs and of its own tests' ZeRO-3 config, Megatron-DeepSpeed's GPT template, DeepSpeedExamples'
Megatron ZeRO-2, ZeRO-Offload, ZeRO-Infinity, ZeRO++, autotuning and AutoTP examples, plus
schedulers (OneCycle too), static/dynamic fp16, "auto" and batch triples), each run for 3 steps on
2 gloo ranks through ``scripts/pretrain_gpt.py --deepspeed-config``, and held to what DeepSpeed would do, read
from ``metrics.jsonl``: the first loss scale is 2**initial_scale_power, a static scale stays put,
the rate of every step is the DeepSpeed scheduler's own formula (written out here from
``deepspeed/runtime/lr_schedules.py``, not from zerotron's schedule), the global batch follows the
batch triple, clipping changes the update, checkpointing is on.

All 15 runs share one launch of 2 ranks (the suite runs on 2 cores): each rank calls ``main`` 15
times, each joining its own gloo group through an env rendezvous as under torchrun.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from pathlib import Path

import pytest

from tests.harness import spawn

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "training" / "deepspeed_configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
SEQ = 32
BASE_YAML = f"""\
model: {{preset: tiny, seq_length: {SEQ}, dropout: 0.0}}
parallel: {{tp: 1}}
optimizer: {{lr: 0.003, min_lr: 0.00001, warmup_steps: 20, weight_decay: 0.1, clip_grad: 1.0}}
training: {{train_steps: 3, micro_batch_size: 4, global_batch_size: 8, precision: fp32}}
logging: {{log_interval: 1, eval_interval: 0, wandb_mode: disabled}}
checkpoint: {{save: null}}
"""
# the Hugging Face configs print every 2000 steps (steps_per_print); a flag wins over it, and "auto" follows one
FLAGS = {"hf_zero2_auto": ["--log-interval", "1"],
         "hf_zero3_auto": ["--log-interval", "1", "--precision", "bf16", "--save", "ck"],
         "hf_tests_zero3": ["--log-interval", "1", "--optimizer.min_lr", "0.0003"]}  # WarmupLR never reads it


def run_all(tmp: str, cache: str) -> dict:
    """On each rank: every config through pretrain_gpt's ``main``; ``{name: (code, stdout, stderr)}``.
    Each ``main`` joins its own group the way torchrun's ranks do: an env rendezvous on the agent's
    store (``TORCHELASTIC_USE_AGENT_STORE``), which rank 0 hosts here on a port the OS gave it and
    holds for the whole loop -- a port picked free and released beforehand could be taken by
    another process in the minutes before its config's turn. Config i joins as torchrun's restart
    i would, under the store prefix that ``runtime._restart_store`` gives restart i, so no group
    reads an earlier one's addresses. The launcher's group is left first."""
    import torch
    import torch.distributed as dist

    from scripts.pretrain_gpt import main

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True) if dist.get_rank() == 0 else None
    port = torch.tensor([agent.port if agent else 0])
    dist.broadcast(port, 0)
    dist.barrier()
    dist.destroy_process_group()
    os.chdir(tmp)  # relative paths of the configs (nvme_path) and the runs land in the test's directory
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(port)),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    out = {}
    for restart, name in enumerate(NAMES):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
        argv = ["--config", f"{tmp}/base.yaml", "--deepspeed-config", str(CONFIGS / f"{name}.json"),
                "--run-dir", f"runs/{name}", "--data.cache_dir", cache, *FLAGS.get(name, [])]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        out[name] = (code, stdout.getvalue(), stderr.getvalue())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, zerotron_cache):
    tmp = tmp_path_factory.mktemp("ds")
    (tmp / "base.yaml").write_text(BASE_YAML)
    results = spawn(run_all, 2, str(tmp), zerotron_cache, timeout=300, collective_timeout=60)
    for name in NAMES:
        codes = [res[name][0] for res in results]
        assert codes == [0, 0], f"{name} exited {codes}: " + " | ".join(
            f"rank {r}: {res[name][2][-1500:]}" for r, res in enumerate(results))
    return tmp, results[0]


def records(tmp: Path, name: str) -> list[dict]:
    lines = (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines if "loss" in json.loads(line)]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in recs)
    return recs


def run_config(tmp: Path, name: str) -> dict:
    import yaml

    return yaml.safe_load((tmp / "runs" / name / "config.yaml").read_text())


# DeepSpeed's lr_schedules, transcribed: the engine sets the rate at construction (iteration -1)
# and steps the scheduler after each optimizer step, so step s (0-based) runs at iteration s - 1.
def ds_warmup_gamma(it: int, warmup: int, kind: str) -> float:
    warmup = max(2, warmup)
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


def warmup_lr(s, lo, hi, warmup, kind="log"):
    it = s - 1
    if it < 0:
        return lo
    gamma = ds_warmup_gamma(it, warmup, kind) if it < max(2, warmup) else 1.0
    return lo + (hi - lo) * gamma


def warmup_decay_lr(s, lo, hi, warmup, total, kind="log"):
    it = s - 1
    if it < 0:
        return lo
    if it < max(2, warmup):
        return lo + (hi - lo) * ds_warmup_gamma(it, warmup, kind)
    return lo + (hi - lo) * max(0.0, (total - it) / max(1.0, total - max(2, warmup)))


def warmup_cosine_lr(s, lr, warmup_ratio, cos_ratio, warmup, total, kind="log"):
    it, w = s - 1, max(2, warmup)
    if it < 0:
        return 0.0
    if it < w:
        return lr * (warmup_ratio + ds_warmup_gamma(it, warmup, kind) * (1 - warmup_ratio))
    progress = min(1.0, (it - w + 1) / max(1, total - w))
    return lr * max(0.0, cos_ratio + (1 - cos_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle(s, lo, hi, up, down, decay_rate=0.0, decay_size=0, moms=(0.8, 0.9), mom_rate=0.0):
    """(rate, beta1) of OneCycle: _get_cycle_lr / _get_cycle_mom, then _get_decay_lr / _get_decay_mom."""
    it = s - 1
    if it < 0:
        return lo, moms[0]
    total = float(up + down)
    if it < total:
        batch_iteration = it + 1
        cycle = math.floor(1 + batch_iteration / total)
        x = 1.0 + batch_iteration / total - cycle
        ratio = up / total
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * scale, moms[1] - (moms[1] - moms[0]) * scale
    if decay_size == 0:
        return lo, moms[1]
    interval = (it - total + 1) / decay_size
    lr = lo if decay_rate == 0 else lo / (1 + decay_rate * interval)
    return lr, moms[1] if mom_rate == 0 else moms[1] * (1 + mom_rate * interval)


def megatron_lr(s, lr, warmup=20):  # the run config's schedule (no scheduler section): warm-up steps
    return lr * (s + 1) / warmup


# name: (global batch, lr of step s, first loss scale or None, static scale)
EXPECT = {
    "hf_zero2_auto": (8, lambda s: warmup_lr(s, 0.0, 0.003, 20), 1.0, False),
    "hf_zero3_auto": (8, lambda s: warmup_decay_lr(s, 0.0, 0.003, 20, 3), 1.0, False),
    "hf_tests_zero3": (8, lambda s: warmup_lr(s, 0.0, 3e-5, 500), 2.0 ** 16, False),
    "megatron_ds_gpt_fp16": (16, lambda s: megatron_lr(s, 0.003), 2.0 ** 11, False),
    "dsexamples_megatron_zero2_static": (16, lambda s: megatron_lr(s, 0.00015), 1024.0, True),
    "zero_offload_decay": (8, lambda s: warmup_decay_lr(s, 1e-5, 1e-3, 2, 5, "linear"), 2.0 ** 16, False),
    "infinity_nvme": (8, lambda s: megatron_lr(s, 0.003), 1.0, False),
    "zeropp_fp16": (8, lambda s: megatron_lr(s, 0.003), 2.0 ** 12, False),
    "autotuning_profiler": (16, lambda s: megatron_lr(s, 0.003), 2.0 ** 15, False),
    "autotp_bfloat16": (8, lambda s: megatron_lr(s, 0.003), 1.0, False),
    "warmup_cosine_adam_l2": (8, lambda s: warmup_cosine_lr(s, 0.004, 0.01, 0.1, 2, 3, "linear"), 1.0, False),
    "bf16_stage3_monitors": (16, lambda s: warmup_lr(s, 0.0, 0.002, 10), 1.0, False),
    "clip_small": (8, lambda s: 0.01, 1.0, False),
    "onecycle_momentum": (8, lambda s: one_cycle(s, 1e-4, 1e-3, 1, 1)[0], 1.0, False),
    "clip_none": (8, lambda s: 0.01, 1.0, False),
}


def test_every_config_is_checked():
    assert len(NAMES) >= 12 and set(NAMES) == set(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_honoured_keys_took_effect(runs, name):
    tmp, _ = runs
    recs = records(tmp, name)
    batch, lr, scale, static = EXPECT[name]
    for s, r in enumerate(recs):
        assert r["lr"] == pytest.approx(lr(s), rel=1e-12, abs=1e-15), (name, s)
        assert round(r["tokens_per_s"] * r["step_time_s"]) == batch * SEQ, (name, s)  # tokens of one step
    assert recs[0]["loss_scale"] == scale
    if static:
        assert [r["loss_scale"] for r in recs] == [scale] * 3


def test_precision_zero_and_checkpointing_as_the_json_says(runs):
    tmp, out = runs
    assert run_config(tmp, "dsexamples_megatron_zero2_static")["activation_checkpointing"]["checkpoint_activations"]
    assert all("saved_activation_device_bytes" in r for r in records(tmp, "dsexamples_megatron_zero2_static"))
    assert all("time_forward_s" in r and "time_step_s" in r for r in records(tmp, "megatron_ds_gpt_fp16"))
    assert not any("time_forward_s" in r for r in records(tmp, "hf_zero2_auto"))  # wall_clock_breakdown false
    want = {"hf_zero2_auto": (2, "fp32"), "hf_zero3_auto": (3, "bf16"), "zeropp_fp16": (3, "fp16"),
            "infinity_nvme": (3, "bf16"), "autotp_bfloat16": (1, "bf16"), "bf16_stage3_monitors": (3, "bf16")}
    for name, (stage, precision) in want.items():
        cfg = run_config(tmp, name)
        assert (cfg["zero"]["stage"], cfg["training"]["precision"]) == (stage, precision), name
    z0 = run_config(tmp, "hf_tests_zero3")["zero"]  # 0 is DeepSpeed's "no prefetch" (ge=0)
    assert (z0["stage"], z0["stage3_prefetch_bucket_size"], z0["reduce_bucket_size"]) == (3, 0, 0)
    z3 = run_config(tmp, "hf_zero3_auto")["zero"]
    assert (z3["offload_param_device"], z3["offload_optimizer_device"], z3["reduce_bucket_size"]) == ("cpu", "cpu", 64 * 64)
    for name in ("hf_zero3_auto", "bf16_stage3_monitors"):  # given as 1e9 / absent: DeepSpeed's 1e9
        z = run_config(tmp, name)["zero"]
        assert (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"]) == (10**9, 10**9), name
    assert run_config(tmp, "autotp_bfloat16")["parallel"]["tp"] == 2  # tensor_parallel.autotp_size
    assert run_config(tmp, "zero_offload_decay")["zero"]["offload_optimizer_device"] == "cpu"  # cpu_offload: true
    assert run_config(tmp, "warmup_cosine_adam_l2")["optimizer"]["adam_w_mode"] is False
    consolidated = list((tmp / "ck").glob("*/consolidated.safetensors"))
    assert len(consolidated) == 1  # stage3_gather_16bit_weights_on_model_save
    from safetensors import safe_open

    with safe_open(str(consolidated[0]), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}


def test_one_cycle_cycles_momentum(runs):
    tmp, _ = runs
    beta1 = [r["beta1"] for r in records(tmp, "onecycle_momentum")]
    assert beta1 == pytest.approx([one_cycle(s, 1e-4, 1e-3, 1, 1, moms=(0.85, 0.95))[1] for s in range(3)],
                                  rel=1e-12)
    assert beta1[0] != beta1[2]
    assert run_config(tmp, "onecycle_momentum")["optimizer"]["beta2"] == 0.99  # OneCycle's (momentum, 0.99)
    assert all(r["beta1"] == 0.9 for r in records(tmp, "hf_zero2_auto"))  # no cycle: the optimizer's beta1


@pytest.mark.parametrize("params", [
    dict(up=3, down=5, decay_rate=0.5, decay_size=2, moms=(0.8, 0.9), mom_rate=0.01),
    dict(up=4, down=4),
    dict(up=2, down=7, decay_rate=1.0, decay_size=3),
])
def test_one_cycle_schedule_over_a_long_run(params):
    """Past the cycle into the decay, against the transcription (no run needed: the run test above
    shows the trainer applies the section's schedule)."""
    from zerotron.config.run_config import OptimizerSection
    from zerotron.zero.lr_schedule import betas_at, lr_at

    moms = params.get("moms", (0.8, 0.9))
    o = OptimizerSection(schedule="onecycle", lr=1e-3, warmup_min_lr=1e-4, warmup_steps=params["up"],
                         cycle_down_steps=params["down"], decay_lr_rate=params.get("decay_rate", 0.0),
                         decay_step_size=params.get("decay_size", 0), cycle_momentum=True, cycle_min_beta1=moms[0],
                         beta1=moms[1], decay_beta1_rate=params.get("mom_rate", 0.0))
    for s in range(40):
        lr, beta1 = one_cycle(s, 1e-4, 1e-3, **params)
        assert lr_at(s, o, 40) == pytest.approx(lr, rel=1e-12), s
        assert betas_at(s, o)[0] == pytest.approx(beta1, rel=1e-12), s


def test_clipping_changes_the_update(runs):
    tmp, _ = runs
    small, none = records(tmp, "clip_small"), records(tmp, "clip_none")
    assert small[0]["loss"] == none[0]["loss"]  # same init and data: only the clipping differs
    assert all(r["grad_norm"] > 0.05 for r in none)  # so gradient_clipping 0.05 is active ...
    assert abs(small[2]["loss"] - none[2]["loss"]) > 1e-6  # ... and changes the trained weights


def test_start_up_lines(runs):
    _, out = runs
    text = {name: o[1] for name, o in out.items()}
    assert "[deepspeed] precedence: YAML (--config) < DeepSpeed JSON (--deepspeed-config) < command-line flags" \
        in text["hf_zero2_auto"]
    assert "[deepspeed] optimizer.params.lr: auto -> 0.003 (optimizer.lr)" in text["hf_zero2_auto"]
    assert "[deepspeed] bf16.enabled: auto -> true (training.precision='bf16') from the command line" \
        in text["hf_zero3_auto"]
    assert "accepted, no effect here: autotuning (" in text["autotuning_profiler"]
    assert "[config] no effect here: optimizer.min_lr=0.0003 (the rate does not decay" in text["hf_tests_zero3"]
    assert "steps_per_print=2000 is overridden by the command line: logging.log_interval=1" in text["hf_zero2_auto"]
    assert "zero_optimization.stage3_max_reuse_distance not given: 1e+09, DeepSpeed's default" \
        in text["bf16_stage3_monitors"]
    for name, (_, stdout, _) in out.items():  # each no-effect key once
        lines = [line for line in stdout.splitlines() if "accepted, no effect here" in line]
        assert len(lines) == len(set(lines)), name
