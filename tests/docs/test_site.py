"""The manual builds, strictly, and fails on what rots; the front page stays a front page.

``mkdocs build --strict`` (``mkdocs.yml``: every validation a warning, so an error under
--strict) is run in a subprocess into a temporary site directory; a copy of the docs with one
link to a missing page and one to a missing anchor must fail it, naming both, which is what
keeps the strict build honest. The configuration page, generated at build time by
``scripts/docs/mkdocs_hooks.py``, must list every ``--section.field`` that ``pretrain_gpt.py
--help`` lists (read from the parser, not from the page's own source). No Markdown file of the
repository may hold an absolute path of a machine (``/work/...``, ``/home/<user>/...``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# an absolute path of some machine, not a URL's path (a letter or dot before the slash) nor a
# placeholder: /work/x, /root/x, /tmp/x, /scratch/x, /home/<user>/x, /Users/<user>/x
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/"
                          r"(?:work|root|tmp|scratch|(?:home|Users)/[A-Za-z_][\w.-]*)/[\w.$-]")

pytest.importorskip("mkdocs", reason="the manual's build needs mkdocs: bash scripts/setup.sh --dev")
pytest.importorskip("material",
                    reason="the manual's theme needs mkdocs-material: bash scripts/setup.sh --dev")


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site``, in a subprocess."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's end-of-life notice
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], cwd=config.parent, env=env, capture_output=True,
                          text=True, timeout=240)


def help_fields() -> list[str]:
    """Every ``--section.field`` that ``pretrain_gpt.py --help`` prints."""
    from zerotron.config.cli import build_parser

    text = build_parser().format_help()
    return sorted(set(re.findall(r"^  (--[a-z_]+\.[a-z0-9_]+)$", text, re.M)))


def test_strict_build_passes(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "--parallel.tp" in page and "Exit codes" in page


def test_strict_build_fails_on_a_missing_page_or_anchor(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("incoming"))
    hook = (ROOT / "scripts" / "docs" / "mkdocs_hooks.py").as_posix()
    config = (ROOT / "mkdocs.yml").read_text().replace("scripts/docs/mkdocs_hooks.py", hook)
    (tmp_path / "mkdocs.yml").write_text(config)
    running = tmp_path / "docs" / "running.md"
    broken = "\nSee [gone](no-such-page.md) and [x](memory.md#no-such-anchor).\n"
    running.write_text(running.read_text() + broken)
    result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr, result.stderr
    assert "no-such-anchor" in result.stderr, result.stderr


def test_configuration_page_lists_every_help_field():
    sys.path.insert(0, str(ROOT / "scripts" / "docs"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts" / "docs"))
    page = mkdocs_hooks.page()
    fields = help_fields()
    assert len(fields) > 90, "--help's field lines were not found: has its layout changed?"
    missing = [f for f in fields if f"`{f}`" not in page]
    assert not missing, f"the configuration page lacks {missing}"
    assert "--tp" in page and "## Exit codes" in page


def markdown_files() -> list[Path]:
    files = [README, ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("configs", "scripts", "tests", "zerotron"):
        files += sorted((ROOT / folder).rglob("*.md"))
    return files


def test_no_machine_path_in_the_docs():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
             for path in markdown_files()
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, "absolute machine paths in the docs:\n" + "\n".join(found)


def test_machine_path_pattern():
    for bad in ("tokenizer /work/clone/.cache/t.model", "`/home/alice/data`", "/tmp/run",
                "(/root/x)"):
        assert MACHINE_PATH.search(bad), bad
    for fine in ("https://github.com/root/x", "runs/tiny/checkpoints", "$TMPDIR/x", "not in /tmp",
                 "~/work/x", "logs/nccl-trace-<job>/"):
        assert not MACHINE_PATH.search(fine), fine


def test_front_page_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250 and len(text.encode()) <= 20 * 1024
    # a newcomer's four questions, answered on the front page
    demo = ("torchrun --standalone --nproc_per_node 4 scripts/pretrain_gpt.py "
            "--config configs/tiny.yaml")
    assert demo in text
    assert ".venv/bin/python -m pytest -q tests" in text
    assert re.search(r"sbatch --nodes 2 scripts/slurm/pretrain_gpt\.sbatch", text)
    assert "docs/index.md" in text
    for target in re.findall(r"\]\(((?:docs|configs|scripts)/[^)#\s]+)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which is not there"


@pytest.mark.parametrize("launcher", ["sbatch --nodes 2", "torchrun --nnodes 2"])
def test_front_page_two_node_commands_validate_at_16_ranks(launcher):
    """The front page's 2 nodes x 8 GPUs commands are runs that pass start-up validation."""
    from zerotron.config.cli import parse_config
    from zerotron.training.setup_run import validate_model

    text = README.read_text().replace("\\\n", " ")  # join continued lines
    line = next(ln for ln in text.splitlines() if launcher in ln)
    argv = line.split("pretrain_gpt.", 1)[1].split()[1:]  # what follows the script's name
    cfg = parse_config([a.strip("'") for a in argv])
    cfg.validate(world_size=16)
    validate_model(cfg).validate(cfg.parallel.tp)
