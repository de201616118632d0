"""The systemd unit that runs the gateway as a service (``passerelle service install``).

The unit in ``deploy/systemd/passerelle.service`` is :func:`render` with its defaults; the command
writes one for this installation (the program that runs, the configuration file, the user).

- ``Type=notify``: started means serving (server/sdnotify.py sends READY=1 once the listener is
  open and a backend can answer), ``WatchdogSec=``: the event loop pings, a hung one is restarted;
  ``ExecReload=`` sends SIGHUP, which re-reads the configuration (RELOADING=1, then READY=1).
- State (keys, usage, runtime logs, learned memory) under ``StateDirectory=`` and the embedded
  llama-server build and model under ``CacheDirectory=``, both owned by the service's user; the
  rest of the file system is read-only to it (``ProtectSystem=strict``), homes are hidden.
- ``KillMode=mixed``: SIGTERM goes to the gateway alone, which finishes its requests and stops the
  runtimes it launched; whatever is left gets SIGKILL after ``TimeoutStopSec=``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

DEFAULT_EXEC = "/usr/local/bin/passerelle"
DEFAULT_CONFIG = "/etc/passerelle/passerelle.toml"
DEFAULT_PATH = "/etc/systemd/system/passerelle.service"


@dataclass(frozen=True)
class UnitOptions:
    exec_start: str = DEFAULT_EXEC  # the passerelle command, as words joined by spaces (quoted)
    config: str = DEFAULT_CONFIG
    user: str = ""  # a user of the machine; empty: a dynamic one allocated by systemd
    watchdog_s: int = 30
    # the first start may build llama-server (minutes); READY=1 comes after it
    start_timeout_s: int = 3600
    stop_timeout_s: int = 90  # above [server] shutdown_grace_s (30 s by default)


def _protect_home(exec_start: str) -> str:
    # a virtualenv under /home or /root must stay readable; otherwise homes are hidden
    program = shlex.split(exec_start)[0] if exec_start else ""
    return "read-only" if program.startswith(("/home/", "/root/")) else "yes"


def render(opts: UnitOptions = UnitOptions()) -> str:
    """The unit's text for ``opts``."""
    who = (f"User={opts.user}\nGroup={opts.user}" if opts.user else
           "# a user allocated at start, owning only the state and cache directories (or User=NAME)\n"
           "DynamicUser=yes")
    return f"""\
# passerelle as a systemd service: `passerelle service install` writes this file, then
#   systemctl daemon-reload && systemctl enable --now passerelle
# Readiness (Type=notify) and the watchdog are sent by the gateway itself.
[Unit]
Description=passerelle, an OpenAI-compatible gateway in front of local LLM runtimes
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={opts.exec_start} serve --config {shlex.quote(opts.config)}
ExecReload=/bin/kill -HUP $MAINPID
KillMode=mixed
Restart=on-failure
RestartSec=2
WatchdogSec={opts.watchdog_s}
TimeoutStartSec={opts.start_timeout_s}
TimeoutStopSec={opts.stop_timeout_s}
{who}
StateDirectory=passerelle
CacheDirectory=passerelle
ConfigurationDirectory=passerelle
Environment=PASSERELLE_STATE=%S/passerelle
Environment=PASSERELLE_CACHE=%C/passerelle
Environment=PYTHONUNBUFFERED=1
LimitNOFILE=65536
UMask=0077
# Sandboxing: everything read-only but the directories above, no privileges to gain.
ProtectSystem=strict
ProtectHome={_protect_home(opts.exec_start)}
PrivateTmp=yes
NoNewPrivileges=yes
CapabilityBoundingSet=
RestrictSUIDSGID=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
LockPersonality=yes
RestrictRealtime=yes
RestrictNamespaces=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
SystemCallArchitectures=native
# The GPU's devices (/dev/dri, /dev/kfd, /dev/nvidia*) stay reachable: no PrivateDevices=.
# Vulkan and ROCm need the device groups: SupplementaryGroups=render video

[Install]
WantedBy=multi-user.target
"""
