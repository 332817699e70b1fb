"""Reading back what moe-report wrote: the Markdown tables of report.md."""
from __future__ import annotations

from pathlib import Path


def markdown_table(md: str, header_cell: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``md`` whose header has ``header_cell``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("|") and f" {header_cell} |" in line)
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")),
                             strict=True)))
    return rows


def fixed_settings(report_dir: Path) -> dict[str, str]:
    """The fixed-settings block of ``report_dir/report.md`` as {setting: value}."""
    rows = markdown_table((report_dir / "report.md").read_text(), "setting")
    return {row["setting"]: row["value"] for row in rows}
