"""Every flag of the data scripts and the ZeRO++ / ZeRO-Infinity benchmarks says what it does.

The parser each script builds is caught at ``parse_args`` (nothing runs), so the check covers
the flags as they are, not a list kept beside them.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["scripts/train_tokenizer.py", "scripts/preprocess_data.py", "scripts/bench/zeropp.py",
           "scripts/bench/infinity.py", "scripts/convert_checkpoint.py", "scripts/estimate_memory.py"]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(script: str) -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location(Path(script).stem + "_flags", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        module.main()
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{script}: main() never parsed its arguments")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_help_text(script):
    parser = _parser_of(script)
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert flags, f"{script} defines no flags"
    silent = [a.option_strings[0] if a.option_strings else a.dest for a in flags
              if not a.help or a.help == argparse.SUPPRESS]
    assert not silent, f"{script}: flags without help text: {silent}"
