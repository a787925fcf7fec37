"""What a person reads on the console of a run: a start-up banner, the elapsed time and ETA of
every log line, and a summary at the end.

The banner says what is about to run -- layout, ZeRO stage, precision, parameters, the memory the
model predicts per rank (``estimate/memory_model.py``), data, tokens per step -- so a wrong layout
or a model that will not fit is seen before the first step, not after an hour. The summary says
what did run and what is left on disk: a checkpoint is named only when this run wrote it.

Figures that need every rank (parameters per rank differ between pipeline stages, peak memory
between ranks) are reduced once in the banner and once in the summary, never per step. Only
global rank 0 prints. Times: elapsed and wall are since the process started (torch import,
data, model build included); the ETA extrapolates this run's mean time per step, evaluations and
checkpoints included.
"""

from __future__ import annotations

import dataclasses
import time

import psutil
import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync

STAGES = {0: "plain DP", 1: "Pos", 2: "Pos+g", 3: "Pos+g+p"}
MIB = 2**20


def duration(seconds: float) -> str:
    """``H:MM:SS`` (``Dd HH:MM:SS`` past a day)."""
    s = max(0, int(round(seconds)))
    d, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{d}d {text:0>8}" if d else text


def count(n: float) -> str:
    """1,234 below a million, then 1.23M / 4.56B."""
    for size, unit in ((1e9, "B"), (1e6, "M")):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,.0f}"


def mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


class RunLog:
    """Built at the end of ``Trainer._build`` on every rank (the banner has one collective)."""

    def __init__(self, trainer):
        self.t = trainer
        self.cfg, self.mcfg, self.grid = trainer.cfg, trainer.mcfg, trainer.grid
        self.process_start = psutil.Process().create_time()
        self.start_step = trainer.step
        self.tokens_per_step = self.cfg.training.global_batch_size * self.mcfg.seq_length
        self.last_checkpoint = None
        self.tracked_peak = 0
        lo, hi = self._reduce_max([-trainer.opt.num_params, trainer.opt.num_params], "banner")
        self.params_per_rank = (int(-lo), int(hi))
        self.params_total = self.mcfg.exact_num_params(self.cfg.parallel.tp)
        self.prediction = self._predict()
        self._loop_t0 = None
        self.t.log(self.banner())

    # figures --------------------------------------------------------------------------------
    def _reduce_max(self, values: list[float], reason: str) -> list[float]:
        x = torch.tensor(values, dtype=torch.float64, device=self.t.env.device)
        C.all_reduce(x, self.grid.world_group, op="max")
        return host_sync.read(x, reason, placeholder=list(values))

    def _predict(self) -> dict | str:
        """The memory model's per-rank estimate, or why this setup is outside it."""
        from zerotron.estimate import memory_model

        try:  # the memory model of this config at this world size
            env = self.t.env
            setup = memory_model.fullest_stage_setup(self.cfg, self.mcfg, self.grid.world_size,
                                                     backend=env.backend, device=env.device.type)
            return memory_model.estimate(setup)
        except ValueError as e:
            return str(e)

    def tracked_config(self) -> dict:
        """The run config for wandb: the ``model`` section resolved (preset plus overrides plus the
        tokenizer's vocabulary, as built), and the parameter counts."""
        out = self.cfg.to_dict()
        out["model"] = {"preset": self.cfg.model.preset, **dataclasses.asdict(self.mcfg),
                        "padded_vocab_size": self.mcfg.padded_vocab_size(self.cfg.parallel.tp)}
        out["params"] = {"total": self.params_total, "per_rank_min": self.params_per_rank[0],
                         "per_rank_max": self.params_per_rank[1], "tokens_per_step": self.tokens_per_step}
        return out

    # the banner -----------------------------------------------------------------------------
    def banner(self) -> str:
        cfg, m, g, t = self.cfg, self.mcfg, self.grid, self.cfg.training
        z, env = cfg.zero, self.t.env
        zero = f"ZeRO stage {z.stage} ({STAGES[z.stage]})"
        if z.optimizer_offload != "none":
            zero += f", optimizer state on {z.optimizer_offload}"
        lo, hi = self.params_per_rank
        per_rank = count(hi) if lo == hi else f"{count(lo)}-{count(hi)} (by pipeline stage)"
        acc = z.grad_accum(t.precision)
        if z.stage <= 1 and not z.contiguous_gradients and cfg.num_microbatches > 1 and acc != t.precision:
            acc = f"{t.precision} over micro-batches, reduced in {acc}: zero.contiguous_gradients is off"
        cp = f" x CP {g.cp_size}" if g.cp_size > 1 else ""  # context parallelism: the sequence split
        lines = [
            f"world {g.world_size} = TP {g.tp_size}{cp} x PP {g.pp_size} x DP {g.dp_size} | {zero} | precision "
            f"{t.precision} (gradients accumulate in {acc}) | {env.device.type}, {env.backend}",
            f"model {cfg.checkpoint.init_from_hf or cfg.model.preset}{_family(m)}: "
            f"{m.num_layers} layers, hidden {m.hidden_size}, "
            f"{m.num_heads} heads{_groups(m)}, vocab "
            f"{m.vocab_size} (padded {m.padded_vocab_size(g.tp_size)}), seq {m.seq_length} | parameters "
            f"{count(self.params_total)} total, {per_rank} per rank (its TP x PP slice)",
            self._memory_line(),
            self._data_line(),
            f"batch {t.global_batch_size} = micro {t.micro_batch_size} x DP {g.dp_size} x {cfg.num_microbatches} "
            f"accumulation | {self.tokens_per_step:,} tokens per step, {t.train_steps} steps = "
            f"{t.train_steps * self.tokens_per_step:,} tokens | lr {cfg.optimizer.lr:g} {cfg.optimizer.decay}, "
            f"{cfg.optimizer.warmup_steps} warm-up",
            self._checkpoint_line(),
        ]
        return "\n".join(f"[zerotron] {line}" for line in lines)

    def _memory_line(self) -> str:
        e = self.prediction
        if isinstance(e, str):
            return f"predicted memory per rank: not modelled ({e})"
        host = f", checkpoints on host {mib(e['checkpoints_host'])}" if e["checkpoints_host"] else ""
        nccl = (f" and {mib(e['nccl_communicators'])} of NCCL communicators"
                if e["nccl_communicators"] else "")  # outside torch's allocator: not in the margin
        terms = (("gathered parameters", "gathered_params"), ("RNG states", "rng_states"))
        rest = "".join(f" + {name} {mib(e[key])}" for name, key in terms
                       if e[key] >= 0.05 * 2**20)  # what rounds to 0.0 MiB is left out
        return (f"predicted memory per rank: {mib(e['before_margin'])} = model states {mib(e['model_states'])} + "
                f"activations {mib(e['checkpoints_device'])} + working {mib(e['working'])} + buffers "
                f"{mib(e['fixed_buffers'])}{rest}{host}; {mib(e['total'])} with the "
                f"{e['fragmentation_margin']:.0%} fragmentation margin{nccl} (estimate/memory_model.py)")

    def _data_line(self) -> str:
        d, data, lg = self.cfg.data, self.t.data, self.cfg.logging
        source = ("built-in corpus (Python standard-library docstrings)" if not d.data_path
                  else ", ".join(data.train_prefixes) + (f" (weights {d.data_weights})" if d.data_weights else ""))
        evals = (f"eval every {lg.eval_interval} steps ({lg.eval_steps} batches)"
                 if self.t.eval_ds is not None else
                 "no evaluation (logging.eval_interval=0)" if lg.eval_interval <= 0 else
                 "no evaluation (no held-out data: set data.eval_path)")
        return f"data: {source} | tokenizer {data.tokenizer_path} | {evals}"

    def _checkpoint_line(self) -> str:
        c, r = self.cfg.checkpoint, self.t.checkpointer.plan
        start = f"resuming at step {self.start_step} from {r.path}" if r.path is not None else "starting from step 0"
        if not c.save:
            return f"checkpoints: none (checkpoint.save is not set) | {start}"
        every = f"every {c.save_interval} steps, " if c.save_interval else ""
        return f"checkpoints: {c.save} ({every}at the end and on SIGTERM; keep {c.keep_last}) | {start}"

    # per log line ---------------------------------------------------------------------------
    def start(self) -> None:
        """The training loop begins: the ETA's clock starts here."""
        self._loop_t0 = time.perf_counter()

    def logged(self, record: dict) -> str:
        """Note a logged record (its tracked memory peak, for the summary); the text its console line
        ends with: ``elapsed H:MM:SS | ETA H:MM:SS``."""
        self.tracked_peak = max(self.tracked_peak, record.get("mem_peak_bytes") or 0,
                                record.get("mem_construction_peak_bytes") or 0)
        step, total = record["step"], self.cfg.training.train_steps
        done = step - self.start_step
        text = f" | elapsed {duration(time.time() - self.process_start)}"
        if self._loop_t0 is not None and done > 0:
            per_step = (time.perf_counter() - self._loop_t0) / done
            text += f" | ETA {duration(per_step * (total - step))}"
        return text

    def saved(self, path) -> None:
        self.last_checkpoint = path

    # the summary ----------------------------------------------------------------------------
    def summary(self, last: dict, stopped: bool) -> None:
        """Printed by rank 0 at the end of ``Trainer.train``; one collective (peak memory over ranks)."""
        peaks = self.t.peaks.run_peaks()
        keys = ["tracked", *peaks]
        values = self._reduce_max([float(self.tracked_peak), *map(float, peaks.values())], "summary")
        peak = dict(zip(keys, values))
        if self.grid.rank != 0:
            return
        t, c = self.cfg.training, self.cfg.checkpoint
        steps = self.t.step - self.start_step
        loop = time.perf_counter() - self._loop_t0 if self._loop_t0 is not None else 0.0
        wall = time.time() - self.process_start
        tokens = steps * self.tokens_per_step
        tps = tokens / loop if loop > 0 else 0.0
        how = "stopped by SIGTERM" if stopped else "done"
        loss = ""
        if "loss" in last:  # the last logged record, which a SIGTERM stop can leave a few steps behind
            at = f" (logged at step {last['step']})" if last.get("step") != self.t.step else ""
            loss = f", loss {last['loss']:.4f}{at}" + (f", eval loss {last['eval_loss']:.4f}" if "eval_loss" in last else "")
        lines = [f"summary: {how} at step {self.t.step} of {t.train_steps}; {steps} steps this run, {tokens:,} tokens{loss}",
                 f"  wall {duration(wall)} (training loop {duration(loop)}) | mean {tps:,.0f} tokens/s | {self._mfu(loop, steps)}",
                 "  " + self._peak_line(peak)]
        if self.last_checkpoint is not None:
            lines.append(f"  last checkpoint: {self.last_checkpoint} (written by this run)")
        elif c.save:
            lines.append(f"  checkpoints: none written by this run (checkpoint.save={c.save})")
        else:
            lines.append("  checkpoints: none (checkpoint.save is not set)")
        print("\n".join(f"[zerotron] {line}" for line in lines), flush=True)

    def _mfu(self, loop: float, steps: int) -> str:
        th = self.t.throughput
        if not th.peak:
            return (f"MFU unknown (no peak TFLOP/s known for {self.t.env.device.type}; set logging.peak_tflops "
                    f"or ZEROTRON_PEAK_TFLOPS)")
        if loop <= 0 or steps <= 0:
            return "MFU: no step ran"
        tflops = th.model_flops * steps / loop / self.grid.world_size / 1e12
        return f"mean MFU {tflops / th.peak:.1%} ({tflops:.2f} of {th.peak:g} TFLOP/s per device)"

    def _peak_line(self, peak: dict) -> str:
        ranks = f"max over {self.grid.world_size} ranks" if self.grid.world_size > 1 else "one rank"
        parts = [f"tensors {mib(peak['tracked'])} (MemoryTracker)"] if peak["tracked"] else []
        if "peak_allocated_bytes" in peak:
            parts.append(f"allocated {mib(peak['peak_allocated_bytes'])}, reserved {mib(peak['peak_reserved_bytes'])}")
        parts.append(f"process RSS {mib(peak['peak_rss_bytes'])}")
        e = self.prediction
        predicted = (f"; predicted {mib(e['before_margin'])} before margin" if isinstance(e, dict) else "")
        return f"peak memory per rank ({ranks}): {', '.join(parts)}{predicted}"


def _family(m) -> str:
    """Nothing for plain GPT-2 (the line as it was), else the Llama-family parts the model has."""
    if m.architecture == "gpt2":
        return " (document masking)" if m.document_masking else ""
    parts = [m.position_embedding_type == "rope" and "RoPE", m.normalization,
             m.activation == "swiglu" and "SwiGLU", not m.tied and "untied",
             m.qk_layernorm and "qk-norm", m.document_masking and "document masking"]
    return " (Llama family: " + ", ".join(p for p in parts if p) + ")"


def _groups(m) -> str:
    return f" ({m.query_groups} query groups)" if m.query_groups != m.num_heads else ""
