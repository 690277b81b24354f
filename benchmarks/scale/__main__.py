"""``python -m benchmarks.scale``: the control plane's costs at N simulated ranks (see README.md)."""

from __future__ import annotations

import argparse
import json
import time

from . import agreements, save_verdicts, sockets, watchdog_sim

PARTS = ("watchdog", "agreements", "sockets", "save_verdicts")


def _table(title: str, rows: list[dict]) -> None:
    print(f"\n### {title}\n")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row.get(c):.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="the watchdog's timeout (hang_timeout), s")
    parser.add_argument("--poll", type=float, default=0.5, help="the watchdog's poll interval, s")
    parser.add_argument("--steady", type=float, default=4.0, help="seconds of steady-state polling measured")
    parser.add_argument(
        "--hang-max-ranks",
        type=int,
        default=1024,
        help="the end-to-end hang (every rank diagnoses at once) runs up to this many ranks",
    )
    parser.add_argument(
        "--socket-ranks",
        type=int,
        nargs="+",
        default=[2, 4, 8],
        help="local processes for the gloo socket count (real process groups)",
    )
    parser.add_argument(
        "--verdict-ranks",
        type=int,
        nargs="+",
        default=[2, 4, 8],
        help="local processes for a save's verdicts (real gloo default group)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    results: dict[str, list] = {}
    begin = time.monotonic()
    if "watchdog" in args.parts:
        results["watchdog"] = [
            watchdog_sim.run(n, args.hang_timeout, args.poll, args.steady, 0.25, hang=n <= args.hang_max_ranks)
            for n in args.ranks
        ]
        _table("hang watchdog", results["watchdog"])
    if "agreements" in args.parts:
        results["agreements"] = [agreements.run(n, all_ranks_note=n <= args.hang_max_ranks) for n in args.ranks]
        _table("store agreements", results["agreements"])
    if "sockets" in args.parts:
        results["sockets"] = [sockets.run(n) for n in args.socket_ranks]
        _table("gloo sockets and threads per rank", results["sockets"])
    if "save_verdicts" in args.parts:
        results["save_verdicts"] = [save_verdicts.run(n) for n in args.verdict_ranks]
        title = "a save's verdicts: separate gloo group (before) and the default group's gloo (now)"
        _table(title, results["save_verdicts"])
        results["verdict_bytes"] = [{"ranks": n, **save_verdicts.payload_bytes(n)} for n in args.ranks]
        _table("bytes one rank receives in a save's verdicts", results["verdict_bytes"])
    print(f"\n(total {time.monotonic() - begin:.0f} s)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
