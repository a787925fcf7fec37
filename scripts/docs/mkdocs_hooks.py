"""MkDocs hooks of the manual (``mkdocs.yml``: ``hooks``).

``on_files`` adds ``configuration.md``, rendered at build time by
``zerotron.config.page`` from the config dataclasses --help reads, with the exit codes of
``scripts/pretrain_gpt.py``; the page is never a file in ``docs/``, so it cannot go stale.
Run directly, this prints the page: ``.venv/bin/python scripts/docs/mkdocs_hooks.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # mkdocs may run from an interpreter without zerotron installed
    sys.path.insert(0, str(ROOT))


def exit_codes() -> str:
    """``EXIT_CODES`` of ``scripts/pretrain_gpt.py``, the text its --help ends with."""
    script = ROOT / "scripts" / "pretrain_gpt.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() runs under __main__
    return module.EXIT_CODES


def page() -> str:
    from zerotron.config.page import render

    return render(exit_codes())


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, "configuration.md", content=page()))
    return files


if __name__ == "__main__":
    print(page())
