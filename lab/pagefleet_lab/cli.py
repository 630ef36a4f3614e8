"""The `pagefleet-lab` command: the lab's benchmarks and the fleet simulator.

    pagefleet-lab simulate|router|autoscale|soak|paired|served-paired|router-cost|core-message [options]
    pagefleet-lab prefix|sharing|kv-waste|fairness|migration [options]

Each subcommand's module is imported only when its parser is built, here for all of them;
results go to benchmarks/results/ unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module under pagefleet_lab, each with `add_parser(sub)` and `run(args)`
COMMANDS = {
    "simulate": "sim.simulate",
    "router": "bench.router",
    "autoscale": "bench.autoscale",
    "soak": "bench.soak",
    "paired": "bench.paired",
    "served-paired": "bench.served_paired",
    "router-cost": "bench.router_cost",
    "core-message": "bench.core_message",
    "prefix": "bench.prefix",
    "sharing": "bench.sharing",
    "kv-waste": "bench.kv_waste",
    "fairness": "sim.fairness",
    "migration": "sim.migration",
}


def _module(command: str):
    return importlib.import_module(f"pagefleet_lab.{COMMANDS[command]}")


def add_lab_parser(parser: argparse.ArgumentParser) -> None:
    """The lab's subcommands under `parser` (`args.bench` names the one given)."""
    sub = parser.add_subparsers(dest="bench", required=True)
    for command in COMMANDS:
        _module(command).add_parser(sub)


def run_lab(args: argparse.Namespace) -> int:
    return _module(args.bench).run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet-lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_lab_parser(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_lab(args)
    except ValueError as e:
        print(f"pagefleet-lab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
