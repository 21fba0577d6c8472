"""Processes on this host."""

from __future__ import annotations

import os


def pid_alive(pid) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
