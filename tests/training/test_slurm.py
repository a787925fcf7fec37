"""``scripts/slurm/pretrain_gpt.sbatch`` on a real (one-node, CPU) SLURM cluster.

The script is submitted from a copy of the checkout (the files git sees: what a fresh clone has,
so a directory the script needs but the checkout lacks fails here as it would on first use),
with the CPU settings its header gives. Checked: the job trains; its output lands where the
header's ``#SBATCH --output`` says; ``scancel --signal=TERM`` -- what ``--signal=TERM@N`` sends N
seconds before the time limit -- makes every rank checkpoint and exit 0 well within those N
seconds, and the job ends COMPLETED, not FAILED or killed.

Skipped, saying why, only where SLURM and munge are missing and cannot be installed
(``slurm_cluster.ensure_installed``). The header's examples are checked without SLURM.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training.slurm_cluster import Cluster, ensure_installed, free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"
RUNNING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def directives() -> dict[str, str]:
    """The script's ``#SBATCH --key=value`` lines."""
    out = {}
    for line in SCRIPT.read_text().splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def header_examples() -> list[list[str]]:
    """The sbatch command lines of the header comment (continuation lines joined)."""
    text = SCRIPT.read_text().split("\n#SBATCH", 1)[0].replace("\\\n#", " ")
    return [shlex.split(ln.lstrip("# ").split("  #")[0]) for ln in text.splitlines() if "sbatch " in ln]


def git_files() -> list[str]:
    res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return [f for f in res.stdout.splitlines() if (ROOT / f).is_file()]


def test_header_examples_name_files_that_exist_and_configs_that_fit_their_gpus():
    from zerotron.config.cli import parse_config

    examples = header_examples()
    assert len(examples) >= 3, examples
    for cmd in examples:
        env = dict(a.split("=", 1) for a in cmd[:cmd.index("sbatch")])
        rest = cmd[cmd.index("sbatch") + 1:]
        script = next(a for a in rest if a.endswith(".sbatch"))
        assert (ROOT / script).is_file(), cmd
        config = rest[rest.index("--config") + 1]
        assert (ROOT / config).is_file(), cmd
        gpus = int(rest[rest.index("--nodes") + 1]) * int(env.get("GPUS_PER_NODE", 8))
        parse_config(["--config", str(ROOT / config)]).validate(gpus)  # raises naming the field if not
    out_dir = Path(directives()["output"]).parent
    assert f"{out_dir}/.gitignore" in git_files(), f"{out_dir}/ must be in the checkout: SLURM opens --output first"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    t0 = time.monotonic()
    why = ensure_installed()
    if why:
        pytest.skip(f"no SLURM here: {why}")
    installed_s = time.monotonic() - t0
    c = Cluster(tmp_path_factory.mktemp("slurm"), cpus=2)
    try:
        c.start()
        yield c
    finally:
        c.stop()
    print(f"[test_slurm] slurm-wlm/munge ready in {installed_s:.1f} s")


@pytest.mark.timeout(1200)  # a first run may install slurm-wlm and munge (apt-get update + install)
def test_the_job_trains_logs_where_the_header_says_and_checkpoints_on_sigterm(cluster, zerotron_cache, tmp_path):
    checkout = tmp_path / "checkout"
    for f in git_files():
        (checkout / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, checkout / f)
    run, ck = tmp_path / "run", tmp_path / "ck"
    args = ["--config", "configs/tiny.yaml", "--train-steps", "500", "--log-interval", "1", "--eval-interval", "0",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--run-dir", str(run),
            "--save", str(ck), "--data.cache_dir", zerotron_cache, "--wandb-mode", "disabled"]
    env = {"GPUS_PER_NODE": "2", "ZEROTRON_PYTHON": sys.executable, "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    sub = cluster.run(["sbatch", "--parsable", "--nodes", "1", "--gpus-per-node", "0", "--cpus-per-task", "2",
                       str(checkout / "scripts" / "slurm" / "pretrain_gpt.sbatch"), *args], cwd=checkout, env=env)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    d = directives()
    log = checkout / d["output"].replace("%x", d["job-name"]).replace("%j", job)

    def wait_for(ready, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = cluster.job(job).get("JobState") not in RUNNING  # before ready(): its last look is final
            if ready():
                return
            if ended:
                break
            time.sleep(0.25)
        text = log.read_text() if log.exists() else "(no log file)"
        pytest.fail(f"{what}; job {cluster.job(job)}\nlog {log}:\n{text[-4000:]}")

    wait_for(lambda: log.exists() and re.search(r"^step 2/500 ", log.read_text(), re.M), 120,
             f"the job did not log step 2 to {log}")
    signalled = time.monotonic()
    assert cluster.run(["scancel", "--signal=TERM", job]).returncode == 0
    wait_for(lambda: cluster.job(job).get("JobState") not in RUNNING, 100,
             "the job did not end after SIGTERM")
    took = time.monotonic() - signalled
    text, state = log.read_text(), cluster.job(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, text[-3000:])
    lead = int(d["signal"].split("@")[1])  # seconds between the signal and the time limit's kill
    assert took < lead / 2, f"SIGTERM to exit took {took:.0f} s of the {lead} s --signal=TERM@{lead} leaves"
    m = re.search(r"SIGTERM: checkpoint written at step (\d+) \((\S+)\); exiting", text)
    assert m, text[-3000:]
    assert Path(m.group(2)) == ck / f"step_{int(m.group(1)):08d}" and (Path(m.group(2)) / "metadata.json").is_file()
    assert "[zerotron] world 2 = TP 2 x PP 1 x DP 1" in text  # the banner
    assert f"[zerotron] summary: stopped by SIGTERM at step {m.group(1)} of 500" in text
    assert f"last checkpoint: {m.group(2)} (written by this run)" in text
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]


def test_the_job_sets_the_cuda_allocator_and_queue_and_no_hca_prefix():
    """DGX set-up (issue 41): expandable segments, one CUDA connection for SP's overlap, and no
    ``NCCL_IB_HCA=mlx5`` default (a prefix match that takes storage ports too)."""
    text = SCRIPT.read_text()
    exports = dict(re.findall(r"^export (\w+)=(.*)$", text, flags=re.M))
    alloc = "${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    assert exports["PYTORCH_CUDA_ALLOC_CONF"] == alloc
    assert exports["CUDA_DEVICE_MAX_CONNECTIONS"] == "${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    assert "NCCL_IB_HCA" not in exports
