"""A throwaway PostgreSQL cluster for the tests: initdb in a fresh dir under /tmp,
started by pg_ctl on a unix socket in that dir (no TCP: ``listen_addresses=''``),
stopped and removed afterwards.

initdb refuses to run as root, so under root every server command runs as the
``postgres`` user (``runuser``) and the dir is handed to that user: pytest's
tmp_path may sit under a 0700 dir the server could not enter. Tests skip only
when the server binaries are truly absent (``.ci/run`` installs them).
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import itertools
import tempfile
from pathlib import Path
from typing import List, Optional

import pytest


def pg_bindir() -> Optional[Path]:
    """The newest installed server's bin dir (Debian: /usr/lib/postgresql/N/bin)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


class PgCluster:
    def __init__(self, bindir: Path, fsync: bool = False):
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="ring-pg-", dir="/tmp"))
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        os.chmod(self.dir, 0o700)
        self._names = itertools.count(1)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--locale=C", "--no-sync")
        settings = {"listen_addresses": "''", "unix_socket_directories": f"'{self.dir}'",
                    "max_connections": "60", "shared_buffers": "'16MB'"}
        if not fsync:
            # Tests: the OS never crashes under them, so skipping fsync loses nothing.
            # synchronous_commit stays on: an immediate stop (a crash of the server)
            # must keep every commit it acknowledged.
            settings.update(fsync="off", full_page_writes="off")
        with open(self.data / "postgresql.auto.conf", "a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self.start()

    def _cmd(self, prog: str, *args: str) -> List[str]:
        argv = [str(self.bindir / prog), *args]
        return ["runuser", "-u", "postgres", "--", *argv] if self.as_root else argv

    def _run(self, prog: str, *args: str, timeout: float = 60) -> None:
        r = subprocess.run(self._cmd(prog, *args), capture_output=True, text=True, timeout=timeout,
                           cwd="/")
        if r.returncode != 0:
            raise RuntimeError(f"{prog} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "30", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def running(self) -> bool:
        r = subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "status"), capture_output=True,
                           cwd="/")
        return r.returncode == 0

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@/{dbname}?host={self.dir}"

    def fresh_dsn(self) -> str:
        """A DSN onto a fresh, empty schema (one ring per schema, via search_path):
        much cheaper than a database per test."""
        import psycopg
        name = f"ring_t{next(self._names)}"
        with psycopg.connect(self.dsn(), autocommit=True) as con:
            con.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
            con.execute(f"CREATE SCHEMA {name}")
        return f"{self.dsn()}&options=-csearch_path%3D{name}"

    def destroy(self) -> None:
        try:
            if self.running():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster():
    bindir = pg_bindir()
    if bindir is None or not (bindir / "initdb").exists():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    pytest.importorskip("psycopg")
    cluster = PgCluster(bindir)
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def pg_dsn(pg_cluster):
    """A fresh schema on the session's cluster (started again if a test stopped it)."""
    if not pg_cluster.running():
        pg_cluster.start()
    return pg_cluster.fresh_dsn()
