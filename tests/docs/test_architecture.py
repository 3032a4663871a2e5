"""docs/architecture.md's module table names every module under megarl/ (a module added without
a row fails here; the row says what it owns)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _table_rows() -> list[tuple[str, str]]:
    """(first column, whole row) of each row of the '## Modules and owners' table."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Modules and owners", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-: ") and cells[0] != "module":
            rows.append((cells[0], line))
    return rows


def _listed(module: Path, rows: list[tuple[str, str]]) -> bool:
    path = module.as_posix()
    package = module.parent.as_posix() + "/"
    for first, row in rows:
        names = re.findall(r"`([^`]+)`", first)
        if path in names:
            return True  # its own row
        if package in names and (module.name == "__init__.py" or f"`{module.name}`" in row or f"{module.name}" in row):
            return True  # named in its package's row
    return False


def test_every_module_has_a_row():
    rows = _table_rows()
    assert rows, "no module table found under '## Modules and owners'"
    modules = sorted(p.relative_to(REPO) for p in (REPO / "megarl").rglob("*.py") if p.parent != REPO / "megarl" or p.name != "__init__.py")
    missing = [m.as_posix() for m in modules if not _listed(m, rows)]
    assert not missing, f"docs/architecture.md's module table misses: {', '.join(missing)}"
