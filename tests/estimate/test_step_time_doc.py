"""docs/step_time.md shows what the step model predicts now: every row's predicted figure is the
one ``scripts/bench/step_time_table.py`` computes from the configs (regenerate the page with the
command it names after changing the model or a preset)."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    """``scripts/bench/step_time_table.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "step_time_table", ROOT / "scripts" / "bench" / "step_time_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    return table


def test_every_row_of_the_page_is_the_model_now():
    table = _generator()
    rows = {r["name"]: r for r in table.paper_rows() + table.megatron_rows()}
    page = (ROOT / "docs" / "step_time.md").read_text()
    # name | GPUs | MP | batch | published | predicted
    row = re.compile(r"^\| ((?:table\d+|megatron)/[\w.-]+) \| \d+ \| \d+ \| \d+ \| "
                     r"([\d.]+) \| ([\d.]+) \|", re.M)
    shown = {m[0]: (float(m[1]), float(m[2])) for m in row.findall(page)}
    assert set(shown) == set(rows)  # every config and Megatron row, no other
    for name, (published, predicted) in shown.items():
        assert published == round(rows[name]["paper"], 1), name
        assert predicted == round(rows[name]["predicted"], 1), (name, rows[name]["predicted"])


def test_the_mp_scaling_table_is_the_model_now():
    """Megatron-LM Table 8's rows on the page are the generator's (speed-ups over one GPU)."""
    table = _generator()
    page = (ROOT / "docs" / "step_time.md").read_text()
    shown = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \|$", page, re.M)
    want = [(str(r["mp"]), f"{r['paper']:.2f}", f"{r['predicted']:.2f}")
            for r in table.mp_scaling_rows()]
    assert shown == want


def test_the_network_sweep_is_the_model_now():
    """The page's second-constant table: each network figure's count of rows within 25 %, as the
    generator computes it (the datasheet's 100 GB/s row equals the tables' own count)."""
    table = _generator()
    page = (ROOT / "docs" / "step_time.md").read_text()
    shown = re.findall(r"^\| ([\d.]+)(?: \(datasheet\))? \| (\d+) of (\d+) \|", page, re.M)
    rows = table.link_sweep_rows()
    assert shown == [(f"{r['gbps']:g}", str(r["rows"] - len(r["outside"])), str(r["rows"]))
                     for r in rows]
    datasheet = next(r for r in rows if r["gbps"] == table.V100_DGX2.inter_node_gbps)
    tables = table.paper_rows()
    within = sum(abs(r["predicted"] / r["paper"] - 1) <= table.TOLERANCE for r in tables)
    assert datasheet["rows"] - len(datasheet["outside"]) == within
