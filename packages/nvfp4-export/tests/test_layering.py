"""nvfp4-export reads checkpoints through the documented on-disk schema, never through nvfp4-train."""

import importlib.util
import subprocess
import sys


def test_export_imports_without_training_or_ops_packages_loaded():
    code = (
        "import sys, nvfp4_export; "
        "bad = [m for m in ('nvfp4_train', 'nvfp4_ops') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"nvfp4_export imported {out.stdout.strip()}"


def test_format_dependency_is_installed():
    assert importlib.util.find_spec("nvfp4_format") is not None
