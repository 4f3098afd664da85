"""``offcore backends``: which backends are installed, which can run here and why not.

$ offcore backends
$ offcore backends --probe --backend cpu -o h2d_bandwidth=16GiB/s
$ offcore backends --probe --json --sizes 64MiB,256MiB
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from offcore.commands._output import format_rate, format_table, write_json

__all__ = ["register", "run", "parse_option"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``backends`` subcommand."""
    parser = subparsers.add_parser(
        "backends",
        help="list backends: available or not (and why), devices, capacity; --probe measures copy bandwidth",
        description=(
            "List every registered offcore backend: whether it can run here and why not, its device count "
            "and device capacity. With --probe, measure copy bandwidth per direction (host-to-device, "
            "device-to-host, and both at once) on each available backend."
        ),
    )
    parser.add_argument("--probe", action="store_true", help="measure copy bandwidth on each available backend")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--backend",
        "-b",
        action="append",
        metavar="NAME[,NAME]",
        help="only these backends (repeatable; default: every registered one)",
    )
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="device option for every listed backend, e.g. -o h2d_bandwidth=16GiB/s -o capacity=4GiB (fake device)",
    )
    parser.add_argument(
        "--sizes",
        default="1MiB,16MiB,64MiB",
        metavar="SIZE[,SIZE]",
        help="copy sizes to probe (default: 1MiB,16MiB,64MiB)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed copies per size and direction (median; default 3)")
    parser.set_defaults(run=run)
    return parser


def parse_option(text: str) -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, value)``; ``true``/``false`` become bools and plain integers ints."""
    from offcore.errors import ConfigurationError

    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ConfigurationError(f"device option {text!r} must look like KEY=VALUE, e.g. capacity=4GiB")
    value = value.strip()
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


def _selected(names: list[str] | None) -> list[Any]:
    import offcore
    from offcore.errors import ConfigurationError

    infos = offcore.backends()
    if not names:
        return infos
    wanted = [n.strip() for value in names for n in value.split(",") if n.strip()]
    by_name = {info.name: info for info in infos}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ConfigurationError(
            f"unknown backend(s) {', '.join(map(repr, unknown))}; registered: {', '.join(sorted(by_name)) or 'none'}"
        )
    return [by_name[n] for n in dict.fromkeys(wanted)]


def _describe(info: Any, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import offcore
    from offcore.bandwidth import measure_copy_bandwidth

    status = info.availability()
    entry: dict[str, Any] = {
        "name": info.name,
        "available": bool(status.available),
        "reason": status.reason,
        "device_count": status.device_count,
        "capacity_bytes": None,
        "description": info.description,
        "plugin": info.plugin,
    }
    if not status.available:
        if args.probe and args.backend:  # asked by name to measure it: an empty table is no answer
            entry["probe_error"] = f"not available, nothing measured: {status.reason}"
        return entry
    try:
        device = offcore.device(info.name, **options)
    except offcore.ConfigurationError as exc:  # a bad -o: a usage error, never a listing that looks fine
        several = not args.backend and sum(other.availability().available for other in offcore.backends()) > 1
        hint = "; to give options to one backend only, add --backend NAME" if several else ""
        given = " ".join(f"-o {text}" for text in args.option) or "no -o options"
        raise offcore.ConfigurationError(f"backend {info.name!r} refused {given}: {exc}{hint}") from None
    except offcore.OffcoreError as exc:
        entry["reason"] = f"creating the device failed: {exc}"
        entry["device_error"] = str(exc)
        return entry
    try:
        entry["capacity_bytes"] = int(device.memory_stats().capacity_bytes)
        if args.probe:
            sizes = [s for s in args.sizes.split(",") if s.strip()]
            progress = None if args.json else (lambda text: print(f"probing {text} ...", file=sys.stderr))
            try:
                probes = measure_copy_bandwidth(device, sizes, repeat=args.repeat, progress=progress)
                entry["probe"] = [p.as_dict() for p in probes]
            except offcore.ConfigurationError:
                raise
            except offcore.OffcoreError as exc:
                entry["probe_error"] = str(exc)
    finally:
        device.synchronize()
        close = getattr(device, "close", None)
        if callable(close):
            close()
    return entry


def run(args: argparse.Namespace) -> int:
    """List (and probe) the backends; exit 1 when creating a device or a probe failed.

    A device option (``-o``) that a listed backend refuses is a
    :class:`~offcore.ConfigurationError` (exit 2), raised before anything is printed.
    """
    from offcore.registry import broken_plugins
    from offcore.units import format_bytes

    options = dict(parse_option(text) for text in args.option)
    entries = [_describe(info, options, args) for info in _selected(args.backend)]
    broken = broken_plugins()
    if args.json:
        write_json({"backends": entries, "broken_plugins": broken}, sys.stdout)
    else:
        rows = [
            [
                e["name"],
                "yes" if e["available"] else "no",
                e["device_count"],
                format_bytes(e["capacity_bytes"]) if e["capacity_bytes"] is not None else "-",
                e["reason"] or "",
            ]
            for e in entries
        ]
        print(format_table(["backend", "available", "devices", "capacity", "reason"], rows))
        for name, reason in sorted(broken.items()):
            print(f"broken plugin {name!r}: {reason}")
        if args.probe:
            probe_rows = [
                [
                    e["name"],
                    format_bytes(p["size_bytes"]),
                    format_rate(p["h2d"]),
                    format_rate(p["d2h"]),
                    format_rate(p["both_h2d"]),
                    format_rate(p["both_d2h"]),
                    p["timing"],
                ]
                for e in entries
                for p in e.get("probe", [])
            ]
            print()
            print("copy bandwidth, GiB/s (median; 'both' = each direction while the other also copies)")
            print(format_table(["backend", "size", "H2D", "D2H", "both: H2D", "both: D2H", "timed by"], probe_rows))
            for e in entries:
                if "probe_error" in e:
                    print(f"{e['name']}: probe failed: {e['probe_error']}")
    return 1 if any("probe_error" in e or "device_error" in e for e in entries) else 0
