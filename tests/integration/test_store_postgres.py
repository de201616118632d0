"""Keys shared by two gateways through a real PostgreSQL (``[store] url``, tenants/pgstore.py),
started by these tests in a temporary directory: a key created on one works on the other, a
revoked one stops on both, and a database that goes away leaves the keys last read in service.

PostgreSQL comes from Debian's ``postgresql`` package (installed by .ci/run); without it these
tests fail, saying so. Run as root, the server runs as the ``postgres`` user."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid

import httpx
import psycopg
import pytest

from passerelle.runtimes.supervisor import free_port
from tests.conftest import upstream_config, wait_until

MODEL = "fake-model"


class Postgres:
    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        assert found, "PostgreSQL is missing: install Debian's 'postgresql' package (.ci/run does)"
        self.bin = os.path.dirname(found[-1])
        self.dir = tempfile.mkdtemp(prefix="passerelle-pg-")
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")
        self.port = free_port()
        self._run("initdb", "-D", f"{self.dir}/data", "-A", "trust", "-U", "passerelle", "--no-sync", "-E", "UTF8")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        proc = subprocess.run([*self.as_user, f"{self.bin}/{tool}", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"{tool} failed:\n{proc.stdout}\n{proc.stderr}"

    def start(self) -> None:
        self._run("pg_ctl", "-D", f"{self.dir}/data", "-l", f"{self.dir}/log", "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", f"{self.dir}/data", "-m", "fast", "-w", "stop")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://passerelle@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        subprocess.run([*self.as_user, f"{self.bin}/pg_ctl", "-D", f"{self.dir}/data", "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres():
    pg = Postgres()
    yield pg
    pg.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PASSERELLE_")}
    return subprocess.run([sys.executable, "-m", "passerelle", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def chat(gw, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).status_code


def shared(fake_url: str, url: str, *, slots: int = 4, store: str = "") -> str:
    return upstream_config(fake_url, model=MODEL, kind="openai", slots=slots) + f"""
    [store]
    url = "{url}"
    poll_s = 0.2
    timeout_s = 2
    {store}
    """


def test_a_key_created_on_one_gateway_works_on_the_other_and_a_revoked_one_stops_on_both(
        postgres, gateway, fake_backend, tmp_path):
    url = postgres.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    a = gateway(shared(fake.url, url))
    b = gateway(shared(fake.url, url), env={"PASSERELLE_STATE": str(tmp_path / "state-b")})
    assert "key store postgresql://passerelle@127.0.0.1" in a.log_text()
    made = cli("keys", "create", "--tenant", "team", "--config", str(a.extra["config"]))
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    key_id = secret.split("_")[1]
    for gw in (a, b):  # within a poll: no restart, no shared file
        # (until a gateway has read the new key, keys are not in use there and any request passes)
        wait_until(lambda gw=gw: chat(gw, None) == 401, 10, what="keys in use")
        assert chat(gw, secret) == 200  # the new key served
    revoked = cli("keys", "revoke", key_id, "--config", str(b.extra["config"]))
    assert revoked.returncode == 0, revoked.stderr
    for gw in (a, b):
        wait_until(lambda gw=gw: chat(gw, secret) == 401, 10, what="the revoked key refused")
    audit = cli("keys", "audit", "--config", str(a.extra["config"]))
    assert [line.split()[2] for line in audit.stdout.splitlines()] == ["create", "revoke"], audit.stdout
    listed = cli("keys", "list", "--all", "--config", str(b.extra["config"]))
    assert key_id in listed.stdout and "revoked" in listed.stdout
    assert listed.stderr.strip() == f"store: {url}"


def test_a_database_that_goes_away_leaves_the_keys_last_read_in_service(postgres, gateway, fake_backend):
    url = postgres.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(shared(fake.url, url))
    secret = cli("keys", "create", "--tenant", "team", "--config", str(gw.extra["config"])).stdout.strip()
    # (until the gateway has read the new key, keys are not in use there and any request passes)
    wait_until(lambda: chat(gw, None) == 401, 10, what="keys in use")
    assert chat(gw, secret) == 200  # the key served
    postgres.stop()
    try:
        wait_until(lambda: "unreachable" in gw.log_text(), 20, what="the loss in the log")
        assert chat(gw, secret) == 200 and chat(gw, "psk_000000000000_wrong") == 401 and chat(gw, None) == 401
    finally:
        postgres.start()
    wait_until(lambda: "reachable again" in gw.log_text(), 30, what="the store back")
    assert chat(gw, secret) == 200


def test_migrations_are_applied_once_by_gateways_starting_together(postgres):
    from passerelle.tenants.pgstore import MIGRATIONS, PgKeyStore

    url = postgres.new_database()
    stores: list[PgKeyStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(PgKeyStore(url, poll_s=5))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors and len(stores) == 4
        with psycopg.connect(url) as conn:
            # each version applied once
            assert sorted(conn.execute("SELECT version FROM passerelle_schema").fetchall()) == [
                (v,) for v in range(1, len(MIGRATIONS) + 1)]
        key, _ = stores[0].create("t", actor="test")
        assert stores[1].get(key.id) == key  # read from the database, not a cache
    finally:
        for s in stores:
            s.close()
