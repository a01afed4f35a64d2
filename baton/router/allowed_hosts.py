"""Where the router may send traffic: every worker receives the client's key and prompt, and in PD
mode the deployment's KV secret. Only hosts the operator allowed may join the worker set."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

LOOPBACK = ("localhost", "127.0.0.0/8", "::1")


class AllowedHosts:
    """Host names (matched exactly, case-insensitively) and IP networks. A name is never resolved
    to be checked: what it resolves to later is the operator's to trust, not a caller's to steer."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            entry = entry.strip().lower().strip("[]")
            if not entry:
                raise ValueError("an allowed worker host is empty")
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if any(c.isspace() or c in "/:@?#" for c in entry):
                    raise ValueError(f"{entry!r} is neither a host name nor an IP network") from None
                self.names.add(entry)

    @classmethod
    def default(cls, worker_urls: Iterable[str]) -> AllowedHosts:
        """Loopback and the hosts of the workers given at start."""
        return cls([*LOOPBACK, *(urlsplit(u).hostname or "" for u in worker_urls if urlsplit(u).hostname)])

    def allows(self, host: str) -> bool:
        host = host.lower().strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host in self.names
        return host in self.names or any(ip.version == n.version and ip in n for n in self.networks)

    def __str__(self) -> str:
        return ", ".join(sorted(self.names) + [str(n) for n in self.networks])
