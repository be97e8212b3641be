"""
pg.py - a throwaway PostgreSQL 15 cluster for the end-to-end tests of the
index in PostgreSQL (index_url). Never a system service: initdb into a
temporary directory as `nobody` (initdb refuses root), pg_ctl start on a
private socket directory and a free loopback port, pg_ctl stop -m immediate
at the end of the session.

Fixtures (registered by conftest.py):
  pg_cluster  one PgCluster for the session (started on first use)
  pg_url      a fresh, empty database in it for one test: its libpq URI

PgCluster.restart(mode) restarts the server ("fast" or "immediate") and
returns once it accepts connections again; stop()/start() split it, so a
test can act while PostgreSQL is down. Skips (not fails) when PostgreSQL 15
is not installed (make deps installs postgresql-15).
"""
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

PGBIN = Path(os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="modeld-pg-"))
        os.chmod(self.dir, 0o755)
        self.data = self.dir / "data"
        self.sock = self.dir / "sock"
        self.data.mkdir()
        self.sock.mkdir()
        self.port = _free_port()
        self.as_user = []
        if os.geteuid() == 0:
            shutil.chown(self.data, "nobody")
            shutil.chown(self.sock, "nobody")
            self.as_user = ["runuser", "-u", "nobody", "--"]
        self._dbs = itertools.count(1)

    def _run(self, *argv, check=True, timeout=60):
        return subprocess.run([*self.as_user, *map(str, argv)], capture_output=True, text=True,
                              check=check, timeout=timeout, stdin=subprocess.DEVNULL)

    def init(self):
        self._run(PGBIN / "initdb", "-D", self.data, "-A", "trust", "-U", "modeld", "--no-sync")
        self.start()
        return self

    def start(self):
        r = self._run(PGBIN / "pg_ctl", "-w", "-D", self.data, "-l", self.sock / "log", "-o",
                      f"-k {self.sock} -p {self.port} -c listen_addresses=127.0.0.1 "
                      f"-c fsync=off", "start", check=False)
        if r.returncode != 0:
            log = (self.sock / "log").read_text(errors="replace") if (self.sock / "log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {r.stderr}\n{log}")

    def stop(self, mode="fast"):
        self._run(PGBIN / "pg_ctl", "-w", "-D", self.data, "-m", mode, "stop", check=False)

    def restart(self, mode="fast"):
        self.stop(mode)
        self.start()

    def psql(self, sql, db="postgres"):
        r = subprocess.run(["psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h",
                            str(self.sock), "-p", str(self.port), "-U", "modeld", "-d", db,
                            "-c", sql], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"psql {sql!r}: {r.stderr}"
        return r.stdout.strip()

    def new_database(self):
        name = f"t{os.getpid()}_{next(self._dbs)}"
        self.psql(f"CREATE DATABASE {name}")
        return f"postgresql://modeld@127.0.0.1:{self.port}/{name}"

    def destroy(self):
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster():
    if not (PGBIN / "initdb").exists() or not shutil.which("psql"):
        pytest.skip(f"PostgreSQL 15 is not installed in {PGBIN} (make deps installs postgresql-15)")
    c = PgCluster()
    try:
        c.init()
        yield c
    finally:
        c.destroy()


@pytest.fixture
def pg_url(pg_cluster):
    return pg_cluster.new_database()
