"""What a running driver loads: a real ``ringd run --once`` over a ring of two
agents, then the interpreter's module table at exit. psutil and OpenSSL's
libcrypto (``hashlib``) are needed only off the ordinary path - a run that
left processes behind, a dead driver's run to reap - and cost the idle driver
about 4.3 MB of RSS together (benchmarks/bench_lap.py's idle figures); rich belongs
to the CLI's output, psycopg to the PostgreSQL journal. And the driver is one
thread: with a second one, each step into and out of a run's cgroup waits for
the core that thread last ran on (an inter-processor interrupt, ~35 us here)."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_LOADED = ("psutil", "_hashlib", "rich", "psycopg")

PROBE = """
import _thread, atexit, json, runpy, sys, threading
report, state = sys.argv[1:3]
threads = []
start_new_thread = _thread.start_new_thread

def counted(*a, **k):   # every thread is started by this (threading keeps its own reference)
    threads.append(repr(a[0]))
    return start_new_thread(*a, **k)
_thread.start_new_thread = threading._start_new_thread = counted
atexit.register(lambda: print(json.dumps({"modules": sorted(sys.modules), "threads": threads}),
                              file=open(report, "w")))
sys.argv = ["ringd", "run", "--once", "--state", state]
runpy.run_module("ringd", run_name="__main__")
"""


def run_probe(tmp_path) -> dict:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "ring.txt").write_text("a /bin/true\nb sh -c 'exit 0'\n")
    (state / "ring.txt").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "RING_STATE", "RING_CONFIG")}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", PROBE, str(out), str(state)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(" ok (exit 0)") == 2, r.stderr   # the ring did turn
    return json.loads(out.read_text())


def test_a_driver_turning_an_ordinary_ring_loads_neither_psutil_nor_openssl(tmp_path):
    loaded = {m.split(".")[0] for m in run_probe(tmp_path)["modules"]}
    assert "ringd" in loaded and not loaded & set(NOT_LOADED), sorted(loaded & set(NOT_LOADED))


def test_the_driver_starts_no_thread(tmp_path):
    assert run_probe(tmp_path)["threads"] == []


def test_the_ring_cgroup_prefix_is_the_sha256_it_always_was():
    """Computed without hashlib now; a different digest would leave a dead driver's
    cgroups (named with the old prefix) to no one."""
    import hashlib
    from ringd.host.cgroup import ring_prefix
    for path in ("/var/lib/ring", "/tmp/x y/é"):
        assert ring_prefix(Path(path)) == "ring-" + hashlib.sha256(path.encode()).hexdigest()[:12]
