"""The live descendants of a process, read from /proc (torchrun starts its workers in sessions of
their own, so a process group does not hold them). Shared by the tests' helpers and the SLURM
stand-in, which runs as a script of its own and must not import the tests' conftest."""

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All live descendant pids of ``pid`` (not ``pid`` itself)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
