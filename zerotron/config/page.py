"""The manual's configuration page, generated from the same source as ``pretrain_gpt.py --help``.

Every row is one field of ``zerotron.config.fields`` (its declaration: type, choices, default,
help) described by ``config_help.describe``, the very string ``--help`` prints for it, and every
short flag is read from the parser ``cli.build_parser`` builds; so the page cannot list a field the
parser lacks or miss one it has. ``scripts/docs/mkdocs_hooks.py`` adds the page to the site at
build time (nothing is written into ``docs/``), and ``tests/docs/test_site.py`` holds it to
``--help``.
"""

from __future__ import annotations

from zerotron.model.presets import PRESETS
from zerotron.config import help as config_help

INTRO = """# Configuration

Every field of the run config, generated from the config's own declaration (the dataclasses of
`zerotron/config/sections.py` and the library sections the run config holds: each field's type,
its choices as a `Literal`, its default and the docstring under it, read by
`zerotron/config/fields.py`), the same source `pretrain_gpt.py --help` prints. A field is
set in three places, later ones winning: the `--config` YAML (`section: {field: value}`), a
DeepSpeed JSON (`--deepspeed-config`, see [DeepSpeed JSON](deepspeed.md)), and the command line
(`--section.field VALUE` or `--section.field=VALUE`, or the short flag beside it). Lists are
comma-separated; `null` or `none` clears an optional field (a type ending in `?`). A field
listed with `one of a|b` takes only those values: any other, from any of the three places, stops
the run before it starts (exit 2) with `section.field=value: use one of [...]` and the field's
help. The resolved config of a run is written to `<run-dir>/config.yaml`.

```bash
.venv/bin/python scripts/pretrain_gpt.py --help     # the same fields, as plain text
```
"""


def _short_flags() -> dict[str, str]:
    """``section.field`` -> its short flag (``--tp``), read from the parser ``--help`` prints."""
    from zerotron.config.cli import build_parser

    flags: dict[str, str] = {}
    for action in build_parser()._actions:  # argparse keeps the declared flags here
        if "." in (action.dest or "") and action.option_strings:
            flags[action.dest] = action.option_strings[0]
    return flags


def _cell(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def render(exit_codes: str = "") -> str:
    """The page's Markdown: one table per section, the presets, then ``exit_codes`` verbatim."""
    shorts = _short_flags()
    lines = [INTRO]
    section = None
    for spec in config_help.run_fields():
        key = spec.key
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines += ["", f"## {section}", "", "| field | short flag | type, default: meaning |",
                      "|---|---|---|"]
        short = f"`{shorts[key]}`" if key in shorts else ""
        meaning = _cell(config_help.describe(spec))  # the very line --help prints
        lines.append(f"| `--{key}` | {short} | {meaning} |")
    lines += ["", "## Presets", "", "`model.preset` names a shape; a `model.*` field left null "
              "takes the preset's value (`zerotron/model/presets.py`).", "",
              "| preset | layers | hidden | heads | sequence |", "|---|---|---|---|---|"]
    shape = ("num_layers", "hidden_size", "num_heads", "seq_length")
    lines += [f"| `{name}` | " + " | ".join(str(getattr(g, f, "")) for f in shape) + " |"
              for name, g in PRESETS.items()]
    lines.append("")
    if exit_codes:
        lines += ["## Exit codes", "", "What `pretrain_gpt.py` exits with (its `--help` ends with "
                  "the same text); torchrun exits 1 when a worker failed.", "",
                  "```", exit_codes, "```", ""]
    return "\n".join(lines)
