"""``kvtop``: a live text view of every kvcached instance's KV memory (no curses).

    kvtop [NAME...] [-r SEC] [--once]
"""

from __future__ import annotations

import argparse
import sys
import time

from kvcached import mem_info
from kvcached.cli.utils import refresh_arg, refresh_seconds
from kvcached.utils import format_size

BAR = 30


def _bar(used: int, prealloc: int, total: int) -> str:
    if total <= 0:
        return "[" + " " * BAR + "]"
    u = min(BAR, round(BAR * used / total))
    p = min(BAR - u, round(BAR * prealloc / total))
    return "[" + "#" * u + "+" * p + "." * (BAR - u - p) + "]"


def render(names: list[str] | None = None) -> str:
    lines = [f"kvtop  {time.strftime('%Y-%m-%d %H:%M:%S')}   # in use   + preallocated   . free under the limit"]
    found = 0
    for name in names or mem_info.list_segments():
        try:
            i = mem_info.read_segment(name)
        except FileNotFoundError:
            lines.append(f"{name}: (no segment)")
            continue
        except (ValueError, OSError, TimeoutError) as exc:  # not a segment, another user's, a stuck writer
            lines.append(f"{name}: {exc}")
            continue
        found += 1
        state = "alive" if mem_info.pid_alive(i.pid) else "DEAD"
        if i.damaged:
            state += ", damaged: a writer died mid-write; kvctl delete removes it"
        limit = "none" if i.limit < 0 else format_size(i.limit)
        lines.append(f"{i.name}  pid {i.pid} ({state})  {i.device}  {i.layout}")
        lines.append(f"  {_bar(i.used_size, i.prealloc_size, i.total_size)}  used {format_size(i.used_size)}"
                     f"  prealloc {format_size(i.prealloc_size)}  limit {limit}  capacity {format_size(i.capacity)}")
    if not found:
        lines.append("No kvcached instances found.")
    return "\n".join(lines)


def kvtop(names: list[str] | None = None, refresh: float = 1.0, once: bool = False) -> None:
    refresh = refresh_seconds(refresh)
    try:
        while True:
            frame = render(names)
            if once:
                print(frame)
                return
            print("\033[2J\033[H" + frame, flush=True)
            time.sleep(refresh)
    except KeyboardInterrupt:
        return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtop", description="Live view of kvcached KV memory.")
    p.add_argument("names", nargs="*")
    p.add_argument("-r", "--refresh", type=refresh_arg, default=1.0, help="seconds between frames (> 0)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    args = p.parse_args(argv)
    kvtop(args.names, args.refresh, args.once)
    return 0


if __name__ == "__main__":
    sys.exit(main())
