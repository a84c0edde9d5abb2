"""Peak memory of a command and every process it starts, together (PSS, so shared pages count once).

    .venv/bin/python benchmarks/peak_memory.py -- .venv/bin/rlver fit --config recipes/quickstart.yaml

Every `--interval` seconds it reads the proportional set size (/proc/PID/smaps_rollup) of the
command's whole process tree (vLLM's engine process, its compile workers, the trainer) and keeps
the largest sum seen, and each process's own peak. Resident sizes (RSS) would count the pages the
processes share (torch's libraries, a fork's copy-on-write memory) once per process; PSS splits
each shared page between its users, so the sum is what the machine holds for the tree. GNU time's
"maximum resident set size" is the largest single process's RSS, not the tree's.

Prints the peak together, the moment it was reached, and the three largest processes at their
own peaks; `--json FILE` writes the same. The command's exit code is passed on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

GIB = 2**30


def pss_bytes(process: psutil.Process) -> int:
    """A process's proportional set size (its RSS where the kernel has no smaps_rollup)."""
    try:
        return int(process.memory_full_info().pss)
    except (psutil.AccessDenied, AttributeError):
        return int(process.memory_info().rss)


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--timeline", type=Path, help="write every sample here (CSV: seconds, GiB together)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")

    started = time.monotonic()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak_total, peak_at = 0, 0.0
    own_peaks: dict[int, tuple[int, str]] = {}
    samples: list[tuple[float, float]] = []
    while child.poll() is None:
        total = 0
        for process in tree(root):
            try:
                size = pss_bytes(process)
                name = " ".join(process.cmdline()[:3])[:80] or process.name()
            except psutil.NoSuchProcess:
                continue
            total += size
            if size > own_peaks.get(process.pid, (0, ""))[0]:
                own_peaks[process.pid] = (size, name)
        samples.append((time.monotonic() - started, total / GIB))
        if total > peak_total:
            peak_total, peak_at = total, time.monotonic() - started
        time.sleep(args.interval)
    largest = sorted(own_peaks.items(), key=lambda item: -item[1][0])[:3]
    print(f"peak memory of all processes together (PSS): {peak_total / GIB:.2f} GiB at {peak_at:.0f} s")
    for pid, (size, name) in largest:
        print(f"  pid {pid}: {size / GIB:.2f} GiB at its own peak  {name}")
    if args.timeline:
        args.timeline.write_text("seconds,gib\n" + "".join(f"{t:.1f},{g:.3f}\n" for t, g in samples))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": command,
                    "peak_gib": peak_total / GIB,
                    "peak_at_s": peak_at,
                    "processes": [
                        {"pid": pid, "gib": size / GIB, "name": name} for pid, (size, name) in largest
                    ],
                    "exit_code": child.returncode,
                },
                indent=1,
            )
        )
    return int(child.returncode)


if __name__ == "__main__":
    sys.exit(main())
