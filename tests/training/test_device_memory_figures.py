"""The trainer's memory figures are the device's, per log window (issue 41, defect 7).

On a GPU the trainer's ``mem_peak_*`` must count device storages only -- ZeRO-Offload's states
and Pa+cpu's checkpoints are host memory -- as the dry run's do, and the allocator's peak must
be the window's, beside the window's other figures, not the run's lifetime high.
"""

from __future__ import annotations

import torch

from tests.harness import spawn
from tests.training.test_trainer import make_config
from zerotron.training.metrics import PeakWindow


def tracked_device(run_dir, cache):
    import torch.distributed as dist

    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    cfg = make_config(run_dir, cache, "--zero.stage", "2", "--zero.offload_optimizer_device", "cpu")
    trainer = Trainer(build_run(cfg.validate(dist.get_world_size()), init_distributed()))
    trainer.train_step()
    return trainer.memory.tracker.device_type, trainer.env.device.type


def test_the_trainer_tracks_the_storages_of_its_own_device(zerotron_cache, tmp_path):
    tracked, device = spawn(tracked_device, 1, tmp_path, zerotron_cache, timeout=240)[0]
    assert tracked == device, (tracked, device)  # None counted host storages on a GPU too


def test_allocator_peaks_are_per_window_and_the_summary_keeps_the_highest(monkeypatch):
    """torch's CUDA allocator counters, stood in for on a CPU machine: a peak and a reset."""
    allocated = {"now": 0, "peak": 0}

    def alloc(n):
        allocated["now"] += n
        allocated["peak"] = max(allocated["peak"], allocated["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: allocated.update(peak=allocated["now"]))
    window = PeakWindow(torch.device("cuda", 0))
    alloc(100), alloc(-100)  # a 100-byte spike in window 1
    assert window.read()["peak_allocated_bytes"] == 100
    alloc(30)  # window 2 holds 30 at most
    assert window.read()["peak_allocated_bytes"] == 30
    assert window.run_peaks()["peak_allocated_bytes"] == 100


def test_pinned_buffers_are_accounted_at_their_power_of_two_blocks(monkeypatch):
    """torch's caching host allocator rounds each pinned block up to a power of two: 12 bytes hold
    16, 1 KiB + 4 bytes hold 2 KiB. Pinning itself needs a GPU, so it is stood in for here."""
    from zerotron.parallel import host_sync

    monkeypatch.setattr(host_sync, "_is_pinned", lambda t: True)
    blocks = [torch.zeros(3), torch.zeros(257), torch.zeros(256)]  # 12, 1028 and 1024 bytes
    assert host_sync.pinned_rounding(blocks) == 4 + 1020 + 0
    monkeypatch.setattr(host_sync, "_is_pinned", lambda t: False)
    assert host_sync.pinned_rounding([torch.zeros(3)]) == 0
