"""Host names are resolved in one place (`distributed.stream_address`): the rendezvous (MASTER_ADDR), gloo's
interface for a job on loopback, and Triton's bind address (server.host). A name that does not resolve is one line
naming its setting; the lookup is replaced here, so no test asks a name server."""
from __future__ import annotations

import datetime
import os
import socket

import pytest

from aligner.runtime import distributed
from aligner.runtime.errors import ConfigError
from servers.triton import TritonSetupError, bind_address


@pytest.fixture
def unresolvable(monkeypatch):
    asked = []

    def lookup(host, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    return asked


def test_rendezvous_names_master_addr(unresolvable):
    with pytest.raises(ConfigError) as raised:
        distributed.rendezvous_store("node-9", 0, 0, 1, datetime.timedelta(seconds=5))
    assert str(raised.value) == ("MASTER_ADDR='node-9' does not resolve (Name or service not known); set it to this "
                                 "machine's address (127.0.0.1 for a job on one machine)")
    assert unresolvable == ["node-9"]


def test_triton_names_server_host(unresolvable):
    with pytest.raises(TritonSetupError) as raised:
        bind_address("node-9")
    assert str(raised.value) == ("server.host='node-9' does not resolve (Name or service not known); give this "
                                 "node's name or address (127.0.0.1: this machine only)")
    assert "\n" not in str(raised.value)


def test_gloo_interface_left_to_the_rendezvous_error(unresolvable, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(distributed, "backend", lambda: "gloo")
    distributed.keep_gloo_on_loopback("node-9")  # no error here: rendezvous_store reports the name
    assert "GLOO_SOCKET_IFNAME" not in os.environ and unresolvable == ["node-9"]


def test_loopback_resolves_everywhere(monkeypatch):
    family, kind, _, address = distributed.stream_address("127.0.0.1", 29500, "MASTER_ADDR")
    assert (family, kind, address) == (socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 29500))
    assert bind_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(distributed, "backend", lambda: "gloo")
    distributed.keep_gloo_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
