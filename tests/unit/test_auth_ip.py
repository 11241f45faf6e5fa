"""IP allow-lists (qag/auth.py): an IPv4 caller seen through a dual-stack IPv6 socket (`::ffff:a.b.c.d`) is the
IPv4 address it maps, whichever way the allow-list writes it; nothing that is not an address matches."""
from __future__ import annotations

import pytest

from qag.auth import ip_allowed, networks


@pytest.mark.parametrize("ip, nets, allowed", [
    ("10.1.2.3", ["10.0.0.0/8"], True),
    ("::ffff:10.1.2.3", ["10.0.0.0/8"], True),          # dual-stack bind: the v4 caller as a mapped v6 address
    ("::ffff:11.1.2.3", ["10.0.0.0/8"], False),
    ("127.0.0.1", ["::ffff:127.0.0.1/128"], True),      # the allow-list written as a mapped address
    ("127.0.0.2", ["::ffff:127.0.0.1/128"], False),
    ("::1", ["127.0.0.1/32"], False),                   # IPv6 loopback is not IPv4 loopback
    ("127.0.0.1", ["::1/128"], False),
    ("2001:db8::5", ["2001:db8::/32"], True),
    ("fe80::1%eth0", ["fe80::/64"], True),              # a zone names the interface, not another address
    ("", ["0.0.0.0/0"], False),
    ("not-an-address", ["0.0.0.0/0", "::/0"], False),
    ("10.1.2.3, 192.168.0.1", ["10.0.0.0/8"], False),    # a forwarded list is never an address
    ("10.1.2.3", ["not-a-network"], False),
])
def test_ip_allowed(ip, nets, allowed):
    assert ip_allowed(ip, networks(nets)) is allowed
