"""`nvfp4-ops doctor`: what this host can run, what `backend="auto"` picks, and (with
`--verify`) whether every available backend agrees with the emulated one here."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _report_host() -> None:
    import jax

    from nvfp4_ops.backends import auto_backend, backend_capabilities, blackwell_devices

    print(
        f"jax {jax.__version__} (jaxlib {_version('jaxlib')}), default backend: {jax.default_backend()}"
    )
    for d in jax.devices():
        cc = getattr(d, "compute_capability", None)
        extra = f", compute capability {cc}" if cc else ""
        print(f"  device {d.id}: {d.platform} {d.device_kind}{extra}")
    print(f"sm_100+ GPUs: {blackwell_devices() or 'none'}")
    print(
        f"nvfp4-format {_version('nvfp4-format')}, nvfp4-ops {_version('nvfp4-ops')}, "
        f"transformer-engine {_version('transformer-engine')}"
    )
    print("backends:")
    for name, (ok, why) in backend_capabilities().items():
        print(f"  {name:9s} {'available' if ok else 'UNAVAILABLE':12s} {why}")
    pick, why = auto_backend()
    print(f"auto -> {pick}: {why}")
    if pick == "emulated":
        print(
            "note: emulated NVFP4 is numerically the recipe but runs no FP4 hardware; "
            "speed-ups need backend 'te' on an sm_100+ GPU."
        )


def _verify(json_path: str | None) -> int:
    from nvfp4_ops.backends import auto_backend, backend_capabilities
    from nvfp4_ops.verify import verify_backend

    names = [n for n, (ok, _) in backend_capabilities().items() if ok and n != "emulated"]
    if not names:
        print("verify: no backend besides 'emulated' is available here; nothing to compare")
    reports = []
    for name in names:
        report = verify_backend(name)
        reports.append(report)
        if report.error is not None:
            verdict = "CRASHED (not used)"
        else:
            verdict = "agrees with emulated" if report.ok else "DISAGREES with emulated"
        print(f"\nverify {name} against emulated: {verdict}")
        print(report.table())
    if names:
        pick, why = auto_backend()
        print(f"\nauto -> {pick} after verification: {why}")
    if json_path:
        Path(json_path).write_text(json.dumps([r.as_dict() for r in reports], indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return 0 if all(r.ok for r in reports) else 1


def doctor(verify: bool = False, json_path: str | None = None) -> int:
    """Print the host report; with `verify`, check each backend and return 1 on a disagreement."""
    _report_host()
    return _verify(json_path) if verify else 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point `nvfp4-ops`."""
    parser = argparse.ArgumentParser(prog="nvfp4-ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="print JAX devices, backend availability and auto's choice")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every available backend against 'emulated' (exit 1 if one disagrees)",
    )
    p.add_argument("--json", metavar="PATH", help="with --verify: write the checks as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    if args.json and not args.verify:
        parser.error("--json needs --verify")
    return doctor(args.verify, args.json)


if __name__ == "__main__":
    sys.exit(main())
