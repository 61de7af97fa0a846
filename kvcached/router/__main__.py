"""``python -m kvcached.router CONFIG``: launch the config's engines, then serve the router until Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from kvcached.errors import KVCachedError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcached.router", description=__doc__)
    ap.add_argument("config", help="TOML, YAML or JSON file naming the models (see kvcached.router.config)")
    ap.add_argument("--port", type=int, help="router port (overrides [router] port)")
    ap.add_argument("--no-launch", action="store_true", help="route only; start no engine")
    args = ap.parse_args(argv)
    try:
        from aiohttp import web
    except ImportError:
        print("kvcached.router needs aiohttp: pip install aiohttp", file=sys.stderr)
        return 2
    from dataclasses import replace

    from kvcached.router.app import Router
    from kvcached.router.config import load_config
    from kvcached.router.engines import Engines

    engines = None
    try:
        config = load_config(args.config)
        if args.port is not None:
            config = replace(config, port=args.port)
        engines = Engines(config)
        if not args.no_launch:
            engines.start()
            took = engines.wait_ready()
            for name, s in took.items():
                print(f"kvcached.router: {name} ready after {s:.1f} s", flush=True)
    except KVCachedError as exc:
        print(f"kvcached.router: {exc}", file=sys.stderr)
        if engines is not None:
            engines.stop()
        return 1
    try:
        web.run_app(Router(config).app(), host=config.host, port=config.port, print=None)
    finally:
        codes = engines.stop()
        if codes:
            print(f"kvcached.router: engines stopped {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
