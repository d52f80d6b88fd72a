"""The README's maps of the code stay true: every file they list exists, with the line count they give."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {"**The book**": ROOT / "manualdp", "**The engine**": ROOT / "manualdp" / "spmd"}


def rows():
    """(folder, file name, lines the README gives) for every row of the book's and the engine's tables."""
    folder, out = None, []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("**"):
            folder = next((d for head, d in SECTIONS.items() if line.startswith(head)), None)
        elif folder is not None and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            names = re.findall(r"`([\w/]+\.py)`", cells[0])
            counts = [int(c) for c in re.findall(r"\d+", cells[1])]
            assert len(names) == len(counts), f"README row {line[:60]!r}: {len(names)} files, {len(counts)} counts"
            out += [(folder, n, c) for n, c in zip(names, counts)]
    return out


def test_the_readme_maps_both_layers():
    found = {folder for folder, _, _ in rows()}
    assert found == set(SECTIONS.values()), "a table of the book or of the engine is missing from the README"


@pytest.mark.parametrize("folder, name, lines", rows(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_listed_file_has_the_lines_the_readme_says(folder, name, lines):
    path = folder / name
    assert path.exists(), f"README lists {path.relative_to(ROOT)}, which does not exist"
    actual = path.read_text().count("\n")
    assert actual == lines, f"README says {path.relative_to(ROOT)} has {lines} lines; it has {actual}"


def test_every_engine_file_is_in_the_readme():
    listed = {name for folder, name, _ in rows() if folder == SECTIONS["**The engine**"]}
    missing = sorted(p.name for p in SECTIONS["**The engine**"].glob("*.py") if p.name != "__init__.py"
                     and p.name not in listed)
    assert not missing, f"engine files missing from the README's table: {missing}"
