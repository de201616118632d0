"""What abusive clients cost the gateway: memory, CPU, sockets, and whether others were served.

Each case starts a fresh gateway (``passerelle serve``) in front of the fake runtime, takes the
gateway's RSS, CPU time and file descriptors, runs the attack while a well-behaved client keeps
sending small streaming chats, and reports:

    case | RSS base | RSS peak | RSS after | CPU s | attackers closed by the gateway | client ok/failed

``--tree DIR`` runs the gateway from another source tree (e.g. an export of an older commit),
so one script measures before and after a change in the same run::

    git archive main | tar -x -C /tmp/before
    .venv/bin/python bench/hostile_clients.py --tree /tmp/before --tree . --out /tmp/hostile.md

The limits a case relies on are given as ``PASSERELLE_SERVER_*`` environment variables, which a
tree that does not know them ignores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import free_port

from passerelle.testing import hostile_clients as hc
from passerelle.testing.fake_runtime import start_fake_backend

MODEL = "fake-model"
LIMITS = {  # short, so a case ends in seconds
    "PASSERELLE_SERVER_HEAD_TIMEOUT_S": "3",
    "PASSERELLE_SERVER_BODY_TIMEOUT_S": "3",
    "PASSERELLE_SERVER_KEEP_ALIVE_S": "3",
}


@dataclass
class Gw:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    probe: hc.Probe

    @property
    def addr(self) -> hc.Addr:
        return ("127.0.0.1", self.port)


@contextlib.contextmanager
def gateway(tree: Path, fake_url: str, work: Path, *, extra_toml: str = "", env: dict[str, str] | None = None,
            nofile: int | None = None) -> Iterator[Gw]:
    port = free_port()
    cfg = work / f"gw-{port}.toml"
    cfg.write_text(f'[[backends]]\nname = "fake"\nkind = "openai"\nurl = "{fake_url}"\nmodels = ["{MODEL}"]\n'
                   f"max_concurrency = 64\n{extra_toml}")
    log = work / f"gw-{port}.log"

    def limit_fds() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port",
                                 str(port)], cwd=tree, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit_fds,
                                env={**os.environ, "PYTHONPATH": str(tree), "PASSERELLE_STATE": str(work / "state"),
                                     **LIMITS, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        fake_port = int(fake_url.rsplit(":", 1)[1])
        gw = Gw(port, proc, log, hc.Probe(proc.pid, {fake_port}))
        for _ in range(3):  # warm up: imports, pools, first allocations
            hc.post(gw.addr, hc.CHAT, hc.chat_body(MODEL, stream=True))
        yield gw
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def mib(kib: int) -> str:
    return f"{kib / 1024:.0f}"


def run_case(name: str, gw: Gw, attack: Callable[[], str], *, client_headers: dict[str, str] | None = None) -> dict:
    base = gw.probe.sample()
    with hc.PeakRss(gw.probe) as peak, hc.WellBehaved(gw.addr, MODEL, timeout=10, headers=client_headers) as client:
        outcome = attack()
    after = gw.probe.sample()
    return {"case": name, "rss_base": mib(base.rss_kib), "rss_peak": mib(peak.peak_kib),
            "rss_after": mib(after.rss_kib), "cpu_s": f"{after.cpu_s - base.cpu_s:.2f}",
            "fds": f"{base.fds}->{after.fds}", "outcome": outcome,
            "client": f"{client.served.ok} ok / {client.served.failed} failed (worst {client.served.worst_s:.1f} s)"}


# --- the cases -------------------------------------------------------------------------------------
def idle_sockets(gw: Gw) -> str:
    socks = hc.open_idle(gw.addr, 300)
    closed, _ = hc.wait_all_closed(socks, 10)
    hc.close_all(socks)
    return f"{closed}/{len(socks)} idle sockets closed by the gateway within 10 s"


def slow_heads(gw: Gw) -> str:
    socks, trickle = hc.slow_heads(gw.addr, 50, interval=0.5)
    closed, got = hc.wait_all_closed(socks, 10)
    trickle.stop()
    hc.close_all(socks)
    answered = sum(hc.status_of(g) == 408 for g in got)
    return f"{closed}/{len(socks)} closed within 10 s ({answered} with 408)"


def slow_bodies(gw: Gw) -> str:
    socks = hc.slow_bodies(gw.addr, 20, declared=8 * 1024 * 1024 - 1, sent=4 * 1024 * 1024)
    closed, got = hc.wait_all_closed(socks, 10)
    hc.close_all(socks)
    answered = sum(hc.status_of(g) == 408 for g in got)
    return f"20 x 4 MiB of 8 MiB, then silence: {closed}/20 closed within 10 s ({answered} with 408)"


def keyless_bodies(gw: Gw) -> str:
    socks = hc.slow_bodies(gw.addr, 15, declared=8 * 1024 * 1024 - 1, sent=0)
    _, got = hc.wait_all_closed(socks, 2)
    hc.close_all(socks)
    refused = sum(hc.status_of(g) == 401 for g in got)
    return f"keys on, no key, 8 MiB announced: {refused}/15 got 401 before sending the body"


def huge_header(gw: Gw) -> str:
    status, took = hc.huge_header(gw.addr, 64 * 1024 * 1024, timeout=60)
    return f"64 MiB header line: answered {status or 'nothing'} after {took:.1f} s"


def many_headers(gw: Gw) -> str:
    return f"2,000 headers: answered {hc.many_headers(gw.addr, 2000) or 'nothing'}"


def many_tenants(gw: Gw) -> str:
    log_before = gw.log.stat().st_size
    db = gw.log.parent / "state"
    db_before = sum(p.stat().st_size for p in db.rglob("*") if p.is_file())
    for i in range(150):
        hc.post(gw.addr, hc.CHAT, hc.chat_body(MODEL, user=f"{i:04d}" + "u" * (1024 * 1024)))
    time.sleep(1)  # the usage rows are written every 0.5 s
    db_after = sum(p.stat().st_size for p in db.rglob("*") if p.is_file())
    return (f"150 x 1 MiB `user`: access log +{(gw.log.stat().st_size - log_before) / 1024:.0f} KiB, "
            f"usage store +{(db_after - db_before) / 1024:.0f} KiB")


def tenant_labels(gw: Gw) -> str:
    # Not more: before the tenant label was bounded, the scrape of 100 x 1 MiB `user` values took
    # the gateway past 20 GB and the kernel killed it.
    for i in range(20):
        hc.post(gw.addr, hc.CHAT, hc.chat_body(MODEL, user=f"{i:04d}" + "u" * (100 * 1024)))
    start = time.monotonic()
    try:
        scrape = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=120).content
        return (f"20 x 100 KiB `user`, then /metrics: {len(scrape) / 1024:.0f} KiB in "
                f"{time.monotonic() - start:.1f} s ({scrape.count(b'passerelle_requests_total{')} request series)")
    except httpx.HTTPError as exc:
        return f"20 x 100 KiB `user`, then /metrics: {exc!r} after {time.monotonic() - start:.0f} s"


def fd_flood(gw: Gw) -> str:
    socks = hc.open_idle(gw.addr, 300)
    time.sleep(0.5)  # let the gateway accept what it will
    start = time.monotonic()
    try:
        raw = hc.post(gw.addr, hc.CHAT, hc.chat_body(MODEL, stream=True), timeout=8)
        took = time.monotonic() - start
        served = f"a request during the flood: {hc.status_of(raw) or 'no answer'} after {took:.1f} s"
    except OSError as exc:
        served = f"a request during the flood: {exc!r}"
    hc.close_all(socks)
    return f"300 idle sockets, fd limit 256: {served}"


def non_reading(gw: Gw) -> str:
    socks = [hc.stream_without_reading(gw.addr, hc.chat_body(MODEL, stream=True, max_tokens=200_000))
             for _ in range(2)]
    start = time.monotonic()
    try:
        raw = hc.post(gw.addr, hc.CHAT, hc.chat_body(MODEL, stream=True), timeout=20)
        served = f"{hc.status_of(raw) or 'no answer'} after {time.monotonic() - start:.1f} s"
    except OSError as exc:
        served = repr(exc)
    hc.close_all(socks)
    return f"2 non-reading streams on a 2-slot runtime, then one more request: {served}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", type=Path, help="source tree to run the gateway from (repeatable)")
    ap.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--work", type=Path, help="keep configurations and gateway logs here (default: a temporary "
                                              "directory)")
    args = ap.parse_args()
    trees = args.tree or [Path.cwd()]
    cases: list[tuple[str, Callable[[Gw], str], dict]] = [
        ("idle sockets", idle_sockets, {}),
        ("slowloris head", slow_heads, {}),
        ("slowloris body", slow_bodies, {}),
        ("keyless bodies", keyless_bodies, {"keys": True}),
        ("huge header", huge_header, {}),
        ("many headers", many_headers, {}),
        ("many tenants", many_tenants, {}),
        ("tenant labels", tenant_labels, {}),
        ("fd flood", fd_flood, {"nofile": 256, "env": {"PASSERELLE_SERVER_MAX_CONNECTIONS": "128"}}),
        ("non-reading clients", non_reading, {"slots": 2}),
    ]
    only = set(args.only.split(",")) if args.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for tree in trees:
            for name, fn, opts in cases:
                if only and name not in only:
                    continue
                fake_opts = {"ttft_ms": 5, "itl_ms": 1, "tokens": 8}
                if opts.get("slots"):
                    fake_opts.update(slots=opts["slots"], itl_ms=0, tokens=200_000)
                with start_fake_backend(**fake_opts) as fake:
                    extra, headers = "", None
                    if opts.get("keys"):
                        db = work / f"keys-{len(rows)}.db"
                        secret = subprocess.run([sys.executable, "-m", "passerelle", "keys", "--db", str(db), "create",
                                                 "--tenant", "good"], cwd=tree, capture_output=True, text=True,
                                                env={**os.environ, "PYTHONPATH": str(tree)}, check=True).stdout.strip()
                        extra, headers = f'[auth]\ndb = "{db}"\n', {"Authorization": f"Bearer {secret}"}
                    with gateway(tree.resolve(), fake.url, work, extra_toml=extra, env=opts.get("env"),
                                 nofile=opts.get("nofile")) as gw:
                        row = run_case(name, gw, lambda gw=gw, fn=fn: fn(gw), client_headers=headers)
                row["tree"] = str(tree)
                rows.append(row)
                print(" | ".join(str(row[k]) for k in ("tree", "case", "rss_base", "rss_peak", "rss_after", "cpu_s",
                                                       "fds", "outcome", "client")), flush=True)
    table = ["| tree | case | RSS base MiB | RSS peak | RSS after | gateway CPU s | fds | outcome | "
             "well-behaved client |", "|---|---|---|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(str(r[k]) for k in ("tree", "case", "rss_base", "rss_peak", "rss_after", "cpu_s",
                                                      "fds", "outcome", "client")) + " |" for r in rows]
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
