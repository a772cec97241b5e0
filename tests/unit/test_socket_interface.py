"""Which interface gloo binds across machines: the route to the store's host."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from evtrain.stages.mesh import pin_socket_interface, route_interface

# /proc/net/route: hex in host byte order (little-endian here): 0.0.0.0/0 via eth0,
# 10.213.7.0/24 on veth1, 10.213.0.0/16 on eth1.
ROUTES = """\
Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
veth1\t0007D50A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth1\t0000D50A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""


@pytest.fixture
def routes(tmp_path: Path) -> Path:
    path = tmp_path / "route"
    path.write_text(ROUTES)
    return path


@pytest.mark.parametrize(
    ("address", "interface"),
    [("10.213.7.2", "veth1"), ("10.213.9.1", "eth1"), ("8.8.8.8", "eth0"), ("::1", None)],
)
def test_the_most_specific_route_names_the_interface(
    routes: Path, address: str, interface: str | None
) -> None:
    assert route_interface(ipaddress.ip_address(address), routes) == interface


def test_a_remote_store_pins_gloo_and_nccl_unless_the_user_did(
    routes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dict of its own: the process's environment (this test runner's, inherited by
    # every launch after it) must not keep what the call sets.
    environ = {"MASTER_ADDR": "10.213.7.1", "NCCL_SOCKET_IFNAME": "ib0"}
    monkeypatch.setattr(os, "environ", environ)
    assert pin_socket_interface(routes) == "veth1"
    assert environ["GLOO_SOCKET_IFNAME"] == "veth1"
    assert environ["NCCL_SOCKET_IFNAME"] == "ib0"  # the user's choice stands


def test_a_local_store_leaves_the_interface_to_gloo(
    routes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ = {"MASTER_ADDR": "127.0.0.1"}
    monkeypatch.setattr(os, "environ", environ)
    assert pin_socket_interface(routes) is None
    assert environ == {"MASTER_ADDR": "127.0.0.1"}
