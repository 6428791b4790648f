"""`nvfp4-ops doctor`: what this host can run, and what `backend="auto"` will pick."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor() -> int:
    """Print JAX version, devices, each backend's availability with its reason, and auto's pick."""
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
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point `nvfp4-ops`."""
    parser = argparse.ArgumentParser(prog="nvfp4-ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="print JAX devices, backend availability and auto's choice")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    if args.command == "doctor":
        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
