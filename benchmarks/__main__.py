"""``python -m benchmarks [--quick] [--json] [--only NAME,...] [--notes]``: see :mod:`benchmarks`.

    argv --> Config.full() | Config.quick_config() --> benchmarks.run(sections) --> table | JSON list
    exit status: 0 done (goals missed or not); 2 bad arguments

NIXL's environment (``NIXL_LOG_LEVEL=WARN``, ``UCX_NET_DEVICES=lo``) is set here, before anything
imports nixl, unless the caller set it already.

Worked number: ``--only plan,memory --quick`` runs 8 pairs x 2 sizes of planning and 8 peak-memory
runs, and no NIXL agent.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from . import SECTIONS, Config, render_table, to_json_list  # noqa: E402
from . import run as run_sections  # noqa: E402
from .common import load_average, quiet, stderr_progress  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options. With :func:`run` this is the interface kvgeom's lazy CLI commands
    use, so a ``kvgeom bench`` module can be ``from benchmarks.__main__ import add_arguments, run``."""
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats, no 128k (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per measurement")
    parser.add_argument("--only", default=",".join(SECTIONS), metavar="NAME,...",
                        help=f"sections to run, comma-separated, from: {', '.join(SECTIONS)}")
    parser.add_argument("--notes", action="store_true", help="print each measurement's note under its row")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    """Run what ``args`` (from :func:`add_arguments`) asks for; returns the exit status."""
    only = [s.strip() for s in str(args.only).split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        print(f"benchmarks: error: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}",
              file=sys.stderr)
        return 2
    config = Config.quick_config() if args.quick else Config.full()
    progress = quiet if args.no_progress else stderr_progress
    progress(f"{'quick' if args.quick else 'full'} run of {', '.join(only)}; python {platform.python_version()}, "
             f"{os.cpu_count()} cpus, load average {load_average()}")
    t0 = time.perf_counter()
    measurements = run_sections(config, only, progress)
    progress(f"done in {time.perf_counter() - t0:.1f} s; load average {load_average()}")
    if args.json:
        json.dump(to_json_list(measurements), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_table(measurements, notes=args.notes))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="kvgeom benchmarks: costs next to their limits, as ratios")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
