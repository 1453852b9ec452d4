"""The README's bad-input table stays true: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _table_rows() -> list[list[str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Bad input, and what you get", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _test_sources() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").rglob("test_*.py"))


def test_the_bad_input_table_has_at_least_25_rows_each_with_a_test() -> None:
    rows = _table_rows()
    assert len(rows) >= 25, len(rows)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))
    sources = _test_sources()
    cli_tests = (REPO / "tests" / "test_cli.py").read_text(encoding="utf-8")
    bad_cases = cli_tests.split("BAD_CASES", 1)[1].split("\n}\n", 1)[0]
    for row in rows:
        names = re.findall(r"`([^`]+)`", row[-1])
        assert names, f"row {row[0]} names no test"
        for name in names:
            if name.startswith("test_"):
                assert re.search(rf"def {re.escape(name)}\(", sources), f"row {row[0]}: no {name}"
            else:
                assert f'"{name}": (' in bad_cases, f"row {row[0]}: no BAD_CASES entry {name!r}"


def test_the_benchmark_section_is_the_generated_one() -> None:
    """The README's results are pasted whole from the runner's output, never typed by hand."""
    generated = (REPO / "benchmarks" / "results" / "README_section.md").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert generated.strip() in readme
    assert "python -m benchmarks.run" in generated


def test_the_solver_table_is_the_registry() -> None:
    """The README's solver table is generated from the registry (python -m benchmarks.readme)."""
    from benchmarks.readme import solver_table

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert solver_table() in readme


@pytest.mark.slow
def test_the_example_run_is_what_the_command_prints() -> None:
    """The README's example output is pasted from the command, never typed (make docs)."""
    from benchmarks.readme import example_output

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert example_output() in readme
