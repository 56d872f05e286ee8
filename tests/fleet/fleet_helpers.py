"""Process checks shared by the fleet tests."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie still answers ``kill(pid, 0)``, so its state is checked too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
