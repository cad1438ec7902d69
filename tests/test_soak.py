"""The fault-injection soak (benchmarks/soak.py), briefly: ~20 s of chaos
against ringwatch + ringd, then every check of the full soak (nothing lost,
one at a time, nothing leaked, the ring kept turning, readers never saw a lock
or a traceback). The 10-minute figures are in docs/failure.md."""
import importlib.util
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")


def load_soak():
    spec = importlib.util.spec_from_file_location("ring_soak", REPO / "benchmarks" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_soak_twenty_seconds(tmp_path):
    soak = load_soak()
    result = soak.run_soak(seconds=20, workdir=tmp_path / "soak", log=lambda _m: None)
    report = result.table()
    print(report)
    assert result.ok, report
    injected = sum(i for kind, (i, _) in result.faults.items() if kind != soak.READERS)
    assert injected >= 5, report
    assert result.faults[soak.READERS][0] >= 5, report
