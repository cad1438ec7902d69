"""What would `filelock` cost the daemons? RSS and import time of ``import
filelock`` (and taking its lock) against ring's own kernel flock
(``ringd.host.lock.KernelLock``), each in a fresh interpreter, median of N runs.

    python3 benchmarks/bench_filelock.py [--runs 15]

filelock must be importable (``pip install filelock``, or PYTHONPATH pointing at
a ``pip install --target`` directory): ring itself does not depend on it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Each probe: start-up RSS is read first, then the import is timed, then the
# lock taken, then RSS again (VmRSS, kB, from /proc/self/status).
PROBE = r"""
import json, os, sys, time
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
before = rss()
t0 = time.perf_counter()
{imports}
took = time.perf_counter() - t0
{lock}
print(json.dumps({{"rss_before_kib": before, "rss_after_kib": rss(), "import_s": took}}))
"""

CASES = {
    "baseline (python, nothing)": ("pass", "pass"),
    "ringd.lock (fcntl.flock)": ("from ringd.host.lock import KernelLock",
                                 "KernelLock(__import__('pathlib').Path(sys.argv[1])).acquire()"),
    "filelock": ("import filelock", "filelock.FileLock(sys.argv[1]).acquire()"),
    # what a running driver would pay on top of what it imports anyway
    "ringd.loops.driver": ("import ringd.loops.driver", "pass"),
    "ringd.loops.driver + filelock": ("import ringd.loops.driver, filelock", "filelock.FileLock(sys.argv[1]).acquire()"),
}


def measure(imports: str, lock: str, lock_path: str) -> dict:
    code = PROBE.format(imports=imports, lock=lock)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code, lock_path], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    try:
        subprocess.run([sys.executable, "-c", "import filelock"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        print("filelock is not importable: pip install filelock (ring does not need it)", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, (imports, lock) in CASES.items():
            runs = [measure(imports, lock, os.path.join(d, f"lock{i}")) for i in range(args.runs)]
            results[name] = {
                "import_ms": statistics.median(r["import_s"] for r in runs) * 1000,
                "rss_added_kib": statistics.median(r["rss_after_kib"] - r["rss_before_kib"] for r in runs),
            }
    base = results["baseline (python, nothing)"]
    print(f"{'':28} {'import (ms)':>12} {'RSS added (KiB)':>16}   median of {args.runs} fresh interpreters")
    for name, r in results.items():
        print(f"{name:28} {r['import_ms']:12.2f} {r['rss_added_kib'] - base['rss_added_kib']:16.0f}")
    d, df = results["ringd.loops.driver"], results["ringd.loops.driver + filelock"]
    print(f"filelock on top of the driver's own imports: +{df['import_ms'] - d['import_ms']:.1f} ms, "
          f"+{(df['rss_added_kib'] - d['rss_added_kib']) / 1024:.1f} MiB RSS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
