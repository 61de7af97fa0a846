"""``kvctl``: list kvcached instances and set their KV memory limits.

    kvctl list [NAME...] [--json]
    kvctl limit NAME SIZE [--revision N]   # 2G, 512M, 1.5GiB, bytes; N: kvcached.control's revision rules
    kvctl limit-percent NAME PCT     # percent of the device's memory
    kvctl peak NAME [--reset]        # most KV memory in use at once (--reset: start a new window)
    kvctl watch [-n SEC] [NAME...]
    kvctl delete NAME
    kvctl serve-metrics [--port 9400] [--host 127.0.0.1] [NAME...]   # Prometheus /metrics (kvcached.metrics)

NAME is the name of a segment in /dev/shm as ``kvctl list`` shows it, never a path:
kvctl touches no file outside /dev/shm, and no file there that is not a kvcached segment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvcached import mem_info
from kvcached.cli.utils import get_kv_cache_limit, refresh_arg, refresh_seconds, update_kv_cache_limit
from kvcached.utils import format_size, parse_size


def _infos(names: list[str] | None) -> list[mem_info.MemInfo]:
    out = []
    for name in names or mem_info.list_segments():
        try:
            out.append(mem_info.read_segment(name))
        except FileNotFoundError:
            print(f"kvctl: no segment named {name!r}", file=sys.stderr)
        except (ValueError, OSError, TimeoutError) as exc:  # one bad segment never hides the others
            print(f"kvctl: {_why(exc)}", file=sys.stderr)
    return out


def _why(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return (f"{exc.filename or 'segment'}: permission denied; a segment is readable and writable by its "
                "engine's user only: run kvctl as that user (or root).")
    return str(exc)


def render_table(infos: list[mem_info.MemInfo]) -> str:
    if not infos:
        return "No kvcached instances found."
    head = f"{'NAME':32} {'PID':>8} {'DEVICE':8} {'LAYOUT':10} {'LIMIT':>11} {'USED':>11} {'PREALLOC':>11} " \
           f"{'PEAK':>11} {'CAPACITY':>11} {'USE%':>6}"
    lines = [head]
    for i in infos:
        pid = f"{i.pid}" if mem_info.pid_alive(i.pid) else f"{i.pid}(dead)"
        limit = "none" if i.limit < 0 else format_size(i.limit)
        pct = 100.0 * i.used_size / i.total_size if i.total_size > 0 else 0.0
        note = "  damaged: a writer died mid-write (kvctl delete removes it)" if i.damaged else ""
        lines.append(f"{i.name:32} {pid:>8} {i.device:8} {i.layout:10} {limit:>11} {format_size(i.used_size):>11} "
                     f"{format_size(i.prealloc_size):>11} {format_size(i.peak_used):>11} "
                     f"{format_size(i.capacity):>11} {pct:5.1f}%{note}")
    return "\n".join(lines)


def cmd_list(names: list[str] | None = None, json_out: bool = False) -> int:
    infos = _infos(names)
    if json_out:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
    else:
        print(render_table(infos))
    return 0 if infos or not names else 1


def _missing(name: str, json_out: bool) -> int:
    msg = f"no kvcached instance named {name!r}"
    names = mem_info.list_segments()
    if names:
        msg += f"; running: {', '.join(names)}"
    if json_out:
        print(json.dumps({"ok": False, "error": msg}))
    print(f"kvctl: {msg}", file=sys.stderr)
    return 1


def _fail(msg: str, json_out: bool, code: int = 1) -> int:
    if json_out:
        print(json.dumps({"ok": False, "error": msg}))
    print(f"kvctl: {msg}", file=sys.stderr)
    return code


def _set(name: str, size: int, json_out: bool) -> int:
    try:
        info = update_kv_cache_limit(name, size)
    except ValueError as exc:  # a file of that name that is not a kvcached segment
        return _fail(str(exc), json_out)
    if info is None:
        return _missing(name, json_out)
    if json_out:
        print(json.dumps({"ok": True, **info.to_dict()}))
    else:
        note = ""
        if size == mem_info.NO_LIMIT:
            print(f"{name}: limit lifted")
            return 0
        if info.used_size > size:
            note = f" (in use now: {format_size(info.used_size)}; the pool shrinks as blocks are freed)"
        print(f"{name}: limit set to {format_size(size)} ({size} B){note}")
    return 0


def cmd_limit(name: str, size_text: str, json_out: bool = False, revision: int | None = None) -> int:
    lift = str(size_text).strip().lower() in ("none", "unlimited", "off")
    try:
        size = mem_info.NO_LIMIT if lift else mem_info.check_limit(parse_size(size_text))
    except ValueError as exc:
        return _fail(str(exc), json_out, 2)
    if revision is None:
        return _set(name, size, json_out)
    return _set_revision(name, None if lift else size, revision, json_out)


def _set_revision(name: str, size: int | None, revision: int, json_out: bool) -> int:
    """``kvctl limit --revision``: kvcached.control's rules (a stale or conflicting revision changes nothing)."""
    from kvcached import control

    try:
        result = control.set_instance_memory_limit(size, revision=revision, name=name)
    except FileNotFoundError:
        return _missing(name, json_out)
    except ValueError as exc:
        return _fail(str(exc), json_out, 2)
    ok = result["status"] not in ("stale", "conflict")
    if json_out:
        print(json.dumps({"ok": ok, **result}))
    else:
        held = "" if ok else f" (it holds revision {result['revision']})"
        print(f"{name}: revision {revision}: {result['status']}{held}"
              + (f" ({result['reason']})" if result["reason"] else ""))
    return 0 if ok else 1


def cmd_limit_percent(name: str, percent: float, json_out: bool = False) -> int:
    if not 0 <= percent <= 100:
        print(f"kvctl: percent must lie in [0, 100], got {percent}", file=sys.stderr)
        return 2
    try:
        info = get_kv_cache_limit(name)
    except ValueError as exc:
        return _fail(str(exc), json_out)
    if info is None:
        return _missing(name, json_out)
    if info.device_total <= 0:
        print(f"kvctl: {name} has not published its device memory yet; use `kvctl limit`.", file=sys.stderr)
        return 1
    return _set(name, int(info.device_total * percent / 100.0), json_out)


def cmd_peak(name: str, reset: bool = False, json_out: bool = False) -> int:
    """Print the peak; with ``reset`` first start a new window and wait until the engine applied it."""
    try:
        if reset:
            info = mem_info.wait_peak_reset(name, mem_info.request_peak_reset(name))
        else:
            info = mem_info.read_segment(name)
    except FileNotFoundError:
        return _missing(name, json_out)
    except (ValueError, TimeoutError) as exc:
        return _fail(str(exc), json_out)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.peak_since_ns / 1e9))
    if json_out:
        print(json.dumps({"ok": True, "name": name, "peak_used": info.peak_used, "used_size": info.used_size,
                          "peak_since_ns": info.peak_since_ns}))
    else:
        print(f"{name}: peak {format_size(info.peak_used)} ({info.peak_used} B) since {since}; "
              f"in use now {format_size(info.used_size)}")
    return 0


def cmd_delete(name: str, json_out: bool = False) -> int:
    try:
        info = get_kv_cache_limit(name)
        if info is None:
            return _missing(name, json_out)
        if mem_info.pid_alive(info.pid):
            print(f"kvctl: note: {name} belongs to the live process {info.pid}; it recreates the segment.",
                  file=sys.stderr)
        mem_info.delete_segment(name)
    except ValueError as exc:
        return _fail(str(exc), json_out)
    print(json.dumps({"ok": True, "deleted": name}) if json_out else f"deleted {name}")
    return 0


def cmd_watch(interval: float, names: list[str] | None, json_out: bool = False, count: int = 0) -> int:
    interval = refresh_seconds(interval)
    n = 0
    try:
        while True:
            infos = _infos(names)
            if json_out:
                print(json.dumps([i.to_dict() for i in infos]), flush=True)
            else:
                print(f"\033[2J\033[H{time.strftime('%H:%M:%S')}\n{render_table(infos)}", flush=True)
            n += 1
            if count and n >= count:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def cmd_serve_metrics(port: int, host: str, names: list[str] | None, json_out: bool = False) -> int:
    """Serve Prometheus ``/metrics`` for the instances (all, or ``names``) until Ctrl-C."""
    from kvcached import metrics

    try:
        server = metrics.serve(port, host, names or None)
    except ValueError as exc:  # no prometheus_client, a bad port
        return _fail(str(exc), json_out, 2)
    url = f"http://{host}:{server.server_port}/metrics"
    print(json.dumps({"ok": True, "url": url}) if json_out else f"kvctl: serving kvcached metrics on {url}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvctl", description="List kvcached instances and set their KV memory limits.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("list", help="list instances and their memory")
    s.add_argument("names", nargs="*")
    s.add_argument("--json", action="store_true", dest="json_sub")
    s = sub.add_parser("limit", help="set an absolute limit, e.g. 2G or 512M; 'none' lifts it")
    s.add_argument("name")
    s.add_argument("size")
    s.add_argument("--revision", type=int, default=None,
                   help="a controller's revision: refused if the segment holds a newer one (see kvcached.control)")
    s.add_argument("--json", action="store_true", dest="json_sub")
    s = sub.add_parser("limit-percent", help="set the limit as a percent of the device's memory")
    s.add_argument("name")
    s.add_argument("percent", type=float)
    s.add_argument("--json", action="store_true", dest="json_sub")
    s = sub.add_parser("peak", help="most KV memory in use at once; --reset starts a new window")
    s.add_argument("name")
    s.add_argument("--reset", action="store_true", help="start a new window (waits until the engine applied it)")
    s.add_argument("--json", action="store_true", dest="json_sub")
    s = sub.add_parser("watch", help="refresh the list every interval")
    s.add_argument("-n", "--interval", type=refresh_arg, default=1.0, help="seconds between frames (> 0)")
    s.add_argument("--count", type=int, default=0, help="stop after this many frames (0: until Ctrl-C)")
    s.add_argument("names", nargs="*")
    s.add_argument("--json", action="store_true", dest="json_sub")
    s = sub.add_parser("serve-metrics", help="serve Prometheus /metrics of the instances (needs prometheus_client)")
    s.add_argument("--port", type=int, default=9400, help="TCP port (0: any free one)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("names", nargs="*")
    s.add_argument("--json", action="store_true", dest="json_sub")
    s = sub.add_parser("delete", help="remove an instance's segment")
    s.add_argument("name")
    s.add_argument("--json", action="store_true", dest="json_sub")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    js = bool(args.json or getattr(args, "json_sub", False))
    try:
        return _dispatch(args, js)
    except (OSError, TimeoutError) as exc:  # another user's segment, a stuck writer: a message, not a traceback
        return _fail(_why(exc), js)


def _dispatch(args: argparse.Namespace, js: bool) -> int:
    names = args.names if hasattr(args, "names") else [args.name]
    for name in names:
        try:
            mem_info.check_name(name)
        except ValueError as exc:  # checked before any file is opened
            return _fail(str(exc), js, 2)
    if args.command == "list":
        return cmd_list(args.names, js)
    if args.command == "limit":
        return cmd_limit(args.name, args.size, js, args.revision)
    if args.command == "limit-percent":
        return cmd_limit_percent(args.name, args.percent, js)
    if args.command == "peak":
        return cmd_peak(args.name, args.reset, js)
    if args.command == "watch":
        return cmd_watch(args.interval, args.names, js, args.count)
    if args.command == "serve-metrics":
        return cmd_serve_metrics(args.port, args.host, args.names, js)
    return cmd_delete(args.name, js)


if __name__ == "__main__":
    sys.exit(main())
