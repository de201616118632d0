"""The namespaces the several-boxes tests stand on: a box answers at its address from the root
namespace and from another box, a pulled cable stops it, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from passerelle.testing.netns import Network, available
from tests.waiting import wait_until


def test_boxes_reach_each_other_a_pulled_cable_cuts_one_and_close_removes_everything() -> None:
    assert available() == ""  # make test runs as root with iproute2 (.ci/run installs it)
    with Network("nt", boxes=2) as net:
        a, b = net.boxes
        a.popen([sys.executable, "-m", "http.server", "--bind", a.address, "8011"], stdout=subprocess.DEVNULL)
        url = f"http://{a.address}:8011/"
        wait_until(lambda: httpx.get(url, timeout=1).status_code == 200, timeout=20)
        probe = f"import httpx; print(httpx.get({url!r}, timeout=5).status_code)"
        seen = subprocess.run(b.command([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=30)
        assert seen.stdout.strip() == "200", seen.stderr[-500:]
        a.link_down()
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=1)
        a.link_up()
        wait_until(lambda: httpx.get(url, timeout=1).status_code == 200, timeout=20)
        names = [box.name for box in net.boxes] + [net.bridge]
    left = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert not any(n in left or n in links for n in names), (left, links)
