"""Processes as ``/proc`` shows them: who is whose parent, and a process's whole tree.

A base module (it imports nothing of passerelle), so that the runtimes' memory readings and the
benchmark's, which may import only the base, share one reading of ``/proc``.

Example::

    process_tree(os.getpid())     # [this process, its children, their children, ...]
"""

from __future__ import annotations

from pathlib import Path


def parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid → parent pid, for every process visible here."""
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 2:
            out[int(entry.name)] = int(rest[1])
    return out


def process_tree(root: int, proc: Path = Path("/proc")) -> list[int]:
    """``root`` and all its descendants (root first, then level by level); ``[]`` when root is gone."""
    table = parents(proc)
    if root not in table:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, ())))
    return out
