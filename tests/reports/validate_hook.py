"""Schema validation of reports written by tests: call validate(path) on every
report a test produces. Standard library only.

    import sys, os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reports"))
    from validate_hook import validate
    validate(path)            # raises AssertionError listing the violations
"""
import os
import subprocess


def validate(path, bin_path=None, timeout=60):
    """Runs `ddpdiag report validate PATH`; returns its stdout when the report
    is valid, raises AssertionError with the listed violations otherwise."""
    exe = bin_path or os.environ.get("DDPDIAG_BIN", "ddpdiag")
    p = subprocess.run([exe, "report", "validate", path], capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise AssertionError("report %s does not match the schema (exit %d):\n%s%s"
                             % (path, p.returncode, p.stdout, p.stderr))
    return p.stdout
