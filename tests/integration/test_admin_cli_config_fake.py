"""``passerelle reload`` and ``passerelle runtime`` addressed by the gateway's configuration file, as
``keys`` and ``usage`` are: its port and its admin key come from the file."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import upstream_config

MODEL = "fake-model"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "passerelle", *args, "--timeout", "30"], capture_output=True,
                          text=True, timeout=90,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PASSERELLE_")})


def test_reload_and_runtime_take_the_port_and_the_admin_key_from_the_file(gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    admin = '\n[admin]\nkey = "3e8b1f0c7a2d94e6b5c0f1a8"\n'
    gw = gateway(upstream_config(fake.url, model=MODEL, kind="openai") + admin)
    cfg = gw.extra["config"]
    port = gw.url.rsplit(":", 1)[1]
    # the file now says where the gateway listens (the fixture gave the port on the command line)
    cfg.write_text(f"[server]\nport = {port}\n" + cfg.read_text())
    no_file = cli("reload", "--url", gw.url)
    assert no_file.returncode == 1 and "admin" in no_file.stderr.lower()  # no key: refused
    done = cli("reload", "--config", str(cfg))
    assert done.returncode == 0, done.stderr
    assert '"unchanged"' in done.stdout and "b1" in done.stdout
    listed = cli("runtime", "list", "--config", str(cfg))
    assert listed.returncode == 0, listed.stderr
    assert "b1" in listed.stdout
