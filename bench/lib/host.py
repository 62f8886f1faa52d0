"""CPU time of the machine and of processes, BPF programs' own counters,
and what else runs: in a namespace testbed every namespace shares the
CPUs, so the drivers take costs as machine-wide deltas, compare them
between paths, and report the builds and benchmarks running beside them
(on a 2-CPU machine they change the numbers)."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import struct
from collections import namedtuple
from pathlib import Path

from .procs import run


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over every CPU from /proc/stat: busy is all
    but idle and iowait (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine (see cpu_jiffies)."""
    return cpu_jiffies()[0] / os.sysconf("SC_CLK_TCK")


def busy_fraction(a: tuple[int, int], b: tuple[int, int]) -> float | None:
    """The share of the CPUs busy between two cpu_jiffies() samples."""
    total = b[1] - a[1]
    return (b[0] - a[0]) / total if total > 0 else None


def _stat_fields(pid: str | int) -> list[str]:
    # After the command name, which may hold spaces and parentheses.
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads)."""
    f = _stat_fields(pid)
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu_s(sid: int) -> float:
    """utime + stime of every process in a session: nginx's master and
    workers, Varnish's manager and child, inband's one process."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = _stat_fields(d)
        except OSError:
            continue
        if int(f[3]) == sid:  # field 6, session id
            total += int(f[11]) + int(f[12])
    return total / os.sysconf("SC_CLK_TCK")



BUILDS = {"cargo", "rustc", "cc1", "cc1plus", "ld", "clang"}
STRESS = {"stress", "stress-ng"}


def others_running() -> set[str]:
    """Other benchmarks, tests and builds on this machine (not this process
    and its parent), by program and arguments: a command line that merely
    mentions ~/.cargo is not a build."""
    me = {os.getpid(), os.getppid()}
    seen = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in me:
            continue
        try:
            argv = [a.decode(errors="replace") for a in open(f"/proc/{d}/cmdline", "rb").read().split(b"\0") if a]
        except OSError:
            continue
        if not argv:
            continue
        prog = os.path.basename(argv[0])
        if prog in BUILDS or prog in STRESS:
            seen.add(prog)
        for a in argv[1:4]:
            if a.startswith("bench.") and a != "bench.docs":
                seen.add(a)
            elif a == "pytest" or a.endswith("/pytest"):
                seen.add("pytest")
        if (prog == "inband" or prog.startswith("inband-")) and argv[1:2] == ["bench"] and len(argv) > 2:
            seen.add(f"inband bench {argv[2]}")
    return seen


_libc = ctypes.CDLL(None, use_errno=True)
# None where the syscall number is unknown: the drivers that need BPF
# statistics refuse to start there (preflight).
SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
_BPF_MAP_LOOKUP_ELEM, _BPF_OBJ_GET, _BPF_OBJ_GET_INFO_BY_FD, _BPF_ENABLE_STATS = 1, 7, 15, 32


def _bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, len(attr))
    r = _libc.syscall(SYS_BPF, cmd, buf, len(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"bpf({cmd}): {os.strerror(e)}")
    return r


def enable_bpf_stats() -> int:
    """BPF_ENABLE_STATS: run time and count of every program while the
    returned fd is open (closed on exit however the driver ends, so the
    machine's setting is never left changed)."""
    return _bpf(_BPF_ENABLE_STATS, struct.pack("I", 0))


_C_SCALARS = {"__u8": "B", "__u16": "H", "__u32": "I", "__u64": "Q"}


def c_struct(header: Path, name: str):
    """(struct.Struct, namedtuple) of `struct name` in a bpf/include header,
    read from the header itself so the drivers never keep a second copy of a
    map layout. Only scalar fields in natural alignment (what our map values
    are); anything else is refused rather than guessed."""
    body = re.search(r"struct %s \{(.*?)\n\};" % re.escape(name), header.read_text(), re.S)
    if body is None:
        raise RuntimeError(f"{header}: no struct {name}")
    fmt, fields = "", []
    for line in re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S).splitlines():
        line = line.strip()
        if not line:
            continue
        m = re.fullmatch(r"(__u8|__u16|__u32|__u64) (\w+);", line)
        if m is None:
            raise RuntimeError(f"{header}: struct {name}: cannot read field {line!r}")
        fmt += _C_SCALARS[m.group(1)]
        fields.append(m.group(2))
    layout = struct.Struct("@" + fmt)
    if layout.size % 8 and "Q" in fmt:
        raise RuntimeError(f"{header}: struct {name}: tail padding is not read here")
    return layout, namedtuple(name, fields)


class PinnedMap:
    """Lookups in a pinned BPF map without spawning a process per read."""

    def __init__(self, path: Path):
        self._path = ctypes.create_string_buffer(str(path).encode())
        self.fd = _bpf(_BPF_OBJ_GET, struct.pack("QII", ctypes.addressof(self._path), 0, 0))
        # struct bpf_map_info: type, id, key_size, value_size, ...
        info = ctypes.create_string_buffer(80)
        _bpf(_BPF_OBJ_GET_INFO_BY_FD, struct.pack("IIQ", self.fd, len(info), ctypes.addressof(info)))
        self.value_size = struct.unpack_from("I", info.raw, 12)[0]

    def lookup(self, key: bytes, value_size: int) -> bytes:
        # The kernel writes the map's whole value: a caller expecting another
        # layout would read garbage, and a smaller buffer would be overrun.
        if value_size != self.value_size:
            raise RuntimeError(f"{self._path.value.decode()}: values are {self.value_size} bytes, not {value_size}: the layout changed")
        k = ctypes.create_string_buffer(key, len(key))
        v = ctypes.create_string_buffer(value_size)
        _bpf(_BPF_MAP_LOOKUP_ELEM, struct.pack("IIQQQ", self.fd, 0, ctypes.addressof(k), ctypes.addressof(v), 0))
        return v.raw

    def close(self) -> None:
        os.close(self.fd)


def xdp_prog_stats(netns: str, dev: str) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the XDP program on `dev`."""
    link = json.loads(run(netns, ["ip", "-j", "link", "show", dev]).stdout)[0]
    prog_id = link["xdp"]["prog"]["id"]
    prog = json.loads(run(None, ["bpftool", "-j", "prog", "show", "id", str(prog_id)]).stdout)
    return int(prog.get("run_time_ns", 0)), int(prog.get("run_cnt", 0))


