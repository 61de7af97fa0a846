"""``kvcached`` command: ``kvcached demo [...]``, ``kvcached ctl ...`` (kvctl), ``kvcached top`` (kvtop)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: kvcached {demo,ctl,top} [args...]   (kvcached demo --help for the demo's options)"
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "demo":
        from kvcached.demo import main as demo_main

        return demo_main(rest)
    if cmd == "ctl":
        from kvcached.cli.kvctl import main as ctl_main

        return ctl_main(rest)
    if cmd == "top":
        from kvcached.cli.kvtop import main as top_main

        return top_main(rest)
    print(f"kvcached: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
