"""Hosts of a cluster simulated on this machine: Linux network namespaces joined by a bridge, each with a NIC of
its own, so what crosses the network between ftrun's nodes crosses real interfaces, not loopback.

Host ``i`` is the namespace ``<prefix>-<i>`` with address ``10.<net>.0.<i + 1>/24`` on a veth whose other end is
on the bridge ``<prefix>``. :meth:`Hosts.shape` limits a host's NIC to a rate (tc ``tbf`` on both ends of its veth,
so what it sends and what it receives each go at most at that rate, as through a real NIC; this kernel has no
``netem``, so no delay or loss). :meth:`Hosts.cut` takes a host off the network and :meth:`Hosts.heal` brings it
back. Processes run in a host through ``ip netns exec`` (:meth:`Hosts.command`): each host has a /dev/shm of its
own (a directory of this machine's, :meth:`Hosts.shm`), as separate machines have; they share the other
filesystems and the CPUs.

Needs root and iproute2 (``ip``, ``tc``; Debian's package is installed with apt when missing): :func:`hosts_problem`
says why not in one line. :meth:`Hosts.close` kills what still runs in the namespaces and removes them and the
bridge.

Run ``python tests/network_hosts.py 3`` to make three hosts by hand (it prints them) and remove them with Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from debian_packages import apt_install


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def hosts_problem() -> str | None:
    """Why network namespaces cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        problem = apt_install("iproute2")  # Debian's package, as etcd's and SLURM's
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return f"iproute2 (ip, tc) is not installed and {problem or 'apt-get install iproute2 gave no ip, tc'}"
    probe = f"ftrun-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Hosts:
    """``count`` hosts on one bridge (see the module doc)."""

    made = 0  # Hosts made by this process: each gets names of its own

    def __init__(self, count: int, prefix: str | None = None) -> None:
        Hosts.made += 1
        self.prefix = prefix or f"ftn{os.getpid() % 100000}x{Hosts.made % 100}"  # interface names: 15 characters
        self.net = 16 + (os.getpid() + Hosts.made) % 200  # 10.<net>.0.0/24 inside the hosts
        self.names = [f"{self.prefix}-{i}" for i in range(count)]
        self._made: list[str] = []
        try:
            _run("ip", "link", "add", self.prefix, "type", "bridge")
            self._made.append("bridge")
            _run("ip", "link", "set", self.prefix, "up")
            for i, name in enumerate(self.names):
                _run("ip", "netns", "add", name)
                self._made.append(name)
                os.makedirs(self.shm(i), mode=0o700)
                _run("ip", "link", "add", self._outer(i), "type", "veth", "peer", "name", "eth0", "netns", name)
                _run("ip", "link", "set", self._outer(i), "master", self.prefix, "up")
                self.exec(i, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                self.exec(i, "ip", "link", "set", "eth0", "up")
                self.exec(i, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    def _outer(self, i: int) -> str:
        return f"{self.prefix}v{i}"  # the veth end on the bridge (names are at most 15 characters)

    def shm(self, i: int) -> str:
        """Host ``i``'s /dev/shm, as this machine sees it."""
        return f"/dev/shm/{self.names[i]}"

    def command(self, i: int, *argv: str) -> list[str]:
        """``argv`` run in host ``i``, with :meth:`shm` as its /dev/shm (``ip netns exec`` gives it a mount
        namespace of its own, where the bind mount stays)."""
        return ["ip", "netns", "exec", self.names[i], "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"',
                self.shm(i), *argv]

    def exec(self, i: int, *argv: str) -> subprocess.CompletedProcess[str]:
        return _run(*self.command(i, *argv))

    def shape(self, i: int, rate_mbit: float | None = None) -> None:
        """Host ``i``'s NIC: at most ``rate_mbit`` megabits per second each way (None: unlimited again)."""
        for device, inside in (("eth0", True), (self._outer(i), False)):
            tc = ["tc", "qdisc", "replace" if rate_mbit else "del", "dev", device, "root"]
            if rate_mbit:
                tc += ["tbf", "rate", f"{rate_mbit}mbit", "burst", "512kb", "latency", "50ms"]
            _run(*(self.command(i, *tc) if inside else tc), check=bool(rate_mbit))

    def cut(self, i: int) -> None:
        """Host ``i`` off the network: its NIC goes down (its connections time out; nothing is refused)."""
        _run("ip", "link", "set", self._outer(i), "down")

    def heal(self, i: int) -> None:
        _run("ip", "link", "set", self._outer(i), "up")

    def received(self, i: int) -> int:
        """Bytes host ``i`` has received so far (what its veth's other end sent)."""
        with open(f"/sys/class/net/{self._outer(i)}/statistics/tx_bytes") as f:
            return int(f.read())

    def pids(self, i: int) -> list[int]:
        done = _run("ip", "netns", "pids", self.names[i], check=False)
        return [int(p) for p in done.stdout.split()]

    def close(self) -> None:
        """Kill every process still in the hosts; remove the namespaces, their veths and the bridge."""
        for i, name in enumerate(self.names):
            if name not in self._made:
                continue
            for pid in self.pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "link", "del", self._outer(i), check=False)
            _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(self.shm(i), ignore_errors=True)
        if "bridge" in self._made:
            _run("ip", "link", "del", self.prefix, check=False)
        self._made.clear()


if __name__ == "__main__":
    problem = hosts_problem()
    if problem:
        sys.exit(problem)
    hosts = Hosts(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    try:
        for n, name in enumerate(hosts.names):
            print(f"{name}: {hosts.address(n)}   (ip netns exec {name} ...)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        hosts.close()
