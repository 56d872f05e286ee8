"""Every module of ``src/kvmesh`` over 450 lines is split or says why it is long.

The reason is the module's first line, a comment ``# Over 450 lines: ...``.
"""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvmesh"
MAX_LINES = 450
REASON = "# Over 450 lines: "


def long_modules_without_reason(root: Path = SRC) -> list[str]:
    """``path (N lines)`` of each module over :data:`MAX_LINES` whose first line gives no reason."""
    missing = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not (lines[0].startswith(REASON) and len(lines[0]) > len(REASON) + 20):
            missing.append(f"{path.relative_to(root)} ({len(lines)} lines)")
    return missing


def test_every_long_module_is_split_or_says_why():
    assert long_modules_without_reason() == []


def test_a_long_module_without_a_reason_is_listed(tmp_path: Path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "explained.py").write_text(
        REASON + "one owner of shared state, split would cross.\n" + "x = 1\n" * MAX_LINES
    )
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_modules_without_reason(tmp_path) == [f"long.py ({MAX_LINES + 1} lines)"]
