"""The systemd unit (deploy/systemd/passerelle.service, server/unit.py): the shipped file is what
``passerelle service install`` renders by default, and ``systemd-analyze verify`` accepts the unit
rendered for this installation, with no warning.

systemd-analyze comes with Debian's ``systemd`` package (installed by .ci/run); without it the
verification tests fail, saying so.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

from passerelle.server.unit import UnitOptions, render

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "systemd" / "passerelle.service"


def verify(unit: Path) -> tuple[int, str]:
    binary = shutil.which("systemd-analyze")
    assert binary, "systemd-analyze is missing: install Debian's 'systemd' package (.ci/run does)"
    proc = subprocess.run([binary, "verify", str(unit)], capture_output=True, text=True, timeout=60,
                          cwd=unit.parent)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def test_the_shipped_unit_is_the_default_rendering():
    assert SHIPPED.read_text() == render(), "deploy/systemd/passerelle.service is stale: regenerate it with render()"


def test_the_unit_rendered_here_verifies_without_a_warning(tmp_path):
    unit = tmp_path / "passerelle.service"
    unit.write_text(render(UnitOptions(exec_start=f"{sys.executable} -m passerelle", config=str(tmp_path / "p.toml"))))
    rc, out = verify(unit)
    assert rc == 0 and out == "", out
    text = unit.read_text()
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30", "ExecReload=/bin/kill -HUP $MAINPID",
                 "DynamicUser=yes", "StateDirectory=passerelle", "CacheDirectory=passerelle",
                 "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes", "KillMode=mixed",
                 "Environment=PASSERELLE_STATE=%S/passerelle", "Environment=PASSERELLE_CACHE=%C/passerelle"):
        assert line in text.splitlines(), line


def test_verify_catches_a_broken_unit(tmp_path):
    # the check above is not vacuous: a wrong setting is reported
    unit = tmp_path / "passerelle.service"
    text = render(UnitOptions(exec_start=sys.executable))
    unit.write_text(text.replace("ProtectSystem=strict", "ProtectSystem=bogus"))
    _, out = verify(unit)
    assert "bogus" in out


def test_homes_stay_readable_only_for_a_program_under_one():
    assert "ProtectHome=yes" in render(UnitOptions(exec_start="/opt/passerelle/bin/passerelle")).splitlines()
    assert "ProtectHome=read-only" in render(UnitOptions(exec_start="/home/ops/.venv/bin/python -m passerelle"))


def test_service_install_writes_the_unit_for_this_installation(tmp_path):
    cfg = tmp_path / "gw.toml"
    cfg.write_text("")
    out = tmp_path / "gw.service"
    proc = subprocess.run([sys.executable, "-m", "passerelle", "service", "install", "--user", "llm", "--config",
                           str(cfg), "--output", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "systemctl daemon-reload && systemctl enable --now gw" in proc.stdout
    lines = out.read_text().splitlines()
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert f"ExecStart={sys.executable} -m passerelle serve --config {cfg}" in lines
    assert "User=llm" in lines and "DynamicUser=yes" not in lines
    printed = subprocess.run([sys.executable, "-m", "passerelle", "service", "install", "--output", "-"],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and "DynamicUser=yes" in printed.stdout


def test_service_install_says_why_it_cannot_write(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "passerelle", "service", "install", "--output",
                           str(tmp_path / "missing" / "x.service")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "cannot write" in proc.stderr and "--output -" in proc.stderr
