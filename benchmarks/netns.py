"""An emulated slow interconnect whose traffic is measured from outside the processes.

A private network namespace is made for one run; its loopback, the only interface in it, is
rate-limited with a token-bucket filter (`tc qdisc ... tbf rate 1gbit`), and Open MPI is told
to use TCP over that loopback only (no shared memory). Every byte the ranks exchange then
crosses the shaped loopback, and the namespace's own interface counters
(/proc/net/dev inside it) count them: a measurement independent of hvd_lowcomm's meter.

Only loopback inside namespaces this module creates is touched; the namespace is deleted on
exit, also when the run fails or is interrupted.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from itertools import count

from hvd_lowcomm.config import rate_bits  # noqa: F401 (tc's units; compare imports it from here)

# Open MPI over TCP on the namespace's loopback only: btl tcp,self excludes shared memory
# (vader), which would bypass the shaped interface.
MPI_OVER_LOOPBACK = ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
                     "--mca", "oob_tcp_if_include", "lo"]
_names = count()


class LinkUnavailable(RuntimeError):
    """Shaping needs root and iproute2 (ip, tc)."""


def check_available() -> None:
    if os.geteuid() != 0:
        raise LinkUnavailable("--link needs root (network namespaces and tc); run as root or drop --link")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(f"--link needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2")


class ShapedLink:
    """`with ShapedLink("1gbit") as link:` run `link.prefix + command`; `link.bytes()` counts."""

    def __init__(self, rate: str) -> None:
        check_available()
        self.rate = rate
        self.rate_bits = rate_bits(rate)
        self.name = f"hvdlc-{os.getpid()}-{next(_names)}"
        self.prefix = ["ip", "netns", "exec", self.name]

    def __enter__(self) -> "ShapedLink":
        _run(["ip", "netns", "add", self.name])
        try:
            _run([*self.prefix, "ip", "link", "set", "lo", "up"])
            # burst: a few full-size loopback packets; latency bounds the queue.
            _run([*self.prefix, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", self.rate,
                  "burst", "256kb", "latency", "100ms"])
        except BaseException:
            self._delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._delete()

    def bytes(self) -> int:
        """Bytes sent through the namespace's loopback so far (each byte is counted once)."""
        out = _run([*self.prefix, "cat", "/proc/net/dev"])
        for line in out.splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])  # transmit bytes
        raise RuntimeError(f"no loopback counters in namespace {self.name}")

    def _delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def _run(command: list[str]) -> str:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.strip()}")
    return proc.stdout
