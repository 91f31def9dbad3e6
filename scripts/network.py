"""What scripts/common.sh asks of the network where iproute2 (ip, ss) is not installed, as on stock GPU, cluster and
container images: answered from the kernel through Python's sockets and /proc alone.

python -m scripts.network route 10.0.0.1   # "local|remote SOURCE INTERFACE" (as ip route get), or exit 1: no route
python -m scripts.network listener 29500   # who listens on TCP port 29500 here (as ss -ltnp), or nothing
"""

import array
import fcntl
import os
import socket
import struct
import sys
from pathlib import Path

SIOCGIFCONF = 0x8912
IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: a 16-byte name, then the address
LISTEN = "0A"  # a socket's state in /proc/net/tcp


def addresses() -> dict[str, str]:
    """Every IPv4 address of this machine and the interface holding it. SIOCGIFCONF lists secondary addresses
    too (SIOCGIFADDR gives one per interface); a label such as eth0:1 is an address of eth0."""
    buffer = array.array("B", bytes(IFREQ_SIZE * 1024))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("iL", len(buffer), buffer.buffer_info()[0])
        length = struct.unpack("iL", fcntl.ioctl(probe.fileno(), SIOCGIFCONF, request))[0]
    data = buffer.tobytes()[:length]
    held = {}
    for start in range(0, length, IFREQ_SIZE):
        name = data[start : start + 16].split(b"\0", 1)[0].decode()
        held.setdefault(socket.inet_ntoa(data[start + 20 : start + 24]), name.split(":", 1)[0])
    return held


def is_local(address: str) -> bool:
    """Whether ``address`` is this machine's: the kernel lets a socket bind only to a local address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def route(address: str) -> tuple[str, str, str] | None:
    """How this machine reaches IPv4 ``address``: ``local`` or ``remote``, the source address packets to it leave
    from (that of a UDP socket connected to it, which sends nothing), and the interface holding the address (for
    one of this machine's, its own; else the source's). None where there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError:
            return None
        source = probe.getsockname()[0]
    held = addresses()
    local = is_local(address)
    interface = held.get(address) if local else None
    interface = interface or held.get(source)
    return ("local" if local else "remote", source, interface) if interface else None


def listener(port: int) -> str | None:
    """Who listens on TCP ``port`` in this network namespace, as "name (pid N)"; None when nobody does."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        lines = Path(table).read_text().splitlines()[1:] if Path(table).exists() else []
        for fields in map(str.split, lines):
            if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                sockets.add(f"socket:[{fields[9]}]")
    if not sockets:
        return None
    for process in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{process}/fd/{fd}") in sockets for fd in os.listdir(f"/proc/{process}/fd")):
                return f"{Path(f'/proc/{process}/comm').read_text().strip()} (pid {process})"
        except OSError:  # gone, or another user's
            continue
    return f"a process this user cannot see (root sees which: the one whose /proc/PID/fd holds {min(sockets)})"


def main() -> int:
    command, value = sys.argv[1:3]
    if command == "route":
        found = route(value)
        if found:
            print(*found)
        return 0 if found else 1
    print(listener(int(value)) or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
