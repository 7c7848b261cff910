"""The seccomp filter of the full tier: system calls through which a job could hold memory or
kernel resources that no limit counts, reach the kernel's riskiest interfaces, or leave its
network namespace, fail with EPERM (or EAFNOSUPPORT for a socket family).

RLIMIT_AS bounds each process's mappings, but System V shared memory outlives its mapping (a
segment stays after ``shmdt``), a memfd grows by ``write`` without being mapped, and a POSIX message
queue lives in the kernel: none of them is counted, so a job could fill the host's memory through
them. Linux AIO contexts (``io_setup``) draw on the host-wide ``fs.aio-max-nr`` budget that
DeepSpeed's async I/O on the same node needs. Refused here too: io_uring, BPF, userfaultfd, perf,
keyrings, ptrace and cross-process memory access (the sandbox has nothing to debug), and new
namespaces: ``unshare``, ``setns`` and a ``clone`` that asks for a user namespace (the one kind
that needs no capability).

Sockets: only AF_UNIX, AF_INET and AF_INET6 may be created (``socket``; ``socketpair`` AF_UNIX
only). The network namespace bounds the last two to the job's own loopback, but not every family
honours namespaces: AF_VSOCK reaches the hypervisor of a VM host (Firecracker, Kata, cloud VMs)
whatever the namespace, and AF_NETLINK, AF_PACKET, Bluetooth, CAN, ALG and the rest are kernel
surface a Python program has no use for. Refused with EAFNOSUPPORT, as a kernel without the family
would answer, so programs take their ordinary fallback.

A classic BPF program built here (no libseccomp for the service's interpreter), handed to bwrap
with ``--seccomp FD``; bwrap installs it, with no-new-privs, just before it runs the job. Built for
x86-64 and aarch64; on another architecture :func:`filter_program` returns None, and the start-up
probe, which tries what the filter refuses, keeps a full-tier service from serving. Any other ABI
(i386 ``int 0x80`` and x32 on x86-64, AArch32 on aarch64) is refused whole, so the numbers below
cannot be dodged.
"""

from __future__ import annotations

import errno
import platform
import socket
import struct
from dataclasses import dataclass

_LD_ABS_W, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_CLONE_NEWUSER = 0x10000000
# seccomp_data: nr at 0, arch at 4, instruction pointer at 8, args[i] at 16 + 8 * i (the low
# half first on these little-endian machines).
_NR, _ARCH, _ARG0 = 0, 4, 16

ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
"""Socket families a job may create (``socketpair``: AF_UNIX only)."""

REFUSED = (
    "shmget", "shmat", "shmctl", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "memfd_create", "memfd_secret",
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "userfaultfd", "perf_event_open", "add_key", "request_key", "keyctl",
    "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns",
)  # fmt: skip
"""System calls refused with EPERM whatever their arguments."""


@dataclass(frozen=True)
class Arch:
    """One architecture's audit id, the system call numbers the filter names, and the number
    range of a second ABI to refuse whole (x32 on x86-64)."""

    audit: int
    numbers: dict[str, int]
    foreign_from: int | None = None


# arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h (aarch64);
# tests/unit/test_sandbox.py checks both against the kernel headers where they are installed.
ARCHES = {
    "x86_64": Arch(
        0xC000003E,
        {
            "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
            "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
            "mq_open": 240, "memfd_create": 319, "memfd_secret": 447,
            "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209,
            "io_cancel": 210, "io_pgetevents": 333,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "bpf": 321, "userfaultfd": 323, "perf_event_open": 298,
            "add_key": 248, "request_key": 249, "keyctl": 250,
            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
            "unshare": 272, "setns": 308, "clone": 56, "clone3": 435, "socket": 41, "socketpair": 53,
        },
        foreign_from=0x40000000,  # the x32 ABI's numbers
    ),
    "aarch64": Arch(
        0xC00000B7,
        {
            "shmget": 194, "shmctl": 195, "shmat": 196, "semget": 190, "semctl": 191,
            "semtimedop": 192, "semop": 193, "msgget": 186, "msgctl": 187, "msgrcv": 188,
            "msgsnd": 189, "mq_open": 180, "memfd_create": 279, "memfd_secret": 447,
            "io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_cancel": 3, "io_getevents": 4,
            "io_pgetevents": 292,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "bpf": 280, "userfaultfd": 282, "perf_event_open": 241,
            "add_key": 217, "request_key": 218, "keyctl": 219,
            "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
            "unshare": 97, "setns": 268, "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199,
        },
    ),
}  # fmt: skip


class _Program:
    """A BPF program with jumps to labels, resolved when it is assembled (classic BPF jumps go
    forward only, at most 255 instructions)."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        """Name the next instruction."""
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((_LD_ABS_W, 0, 0, offset))

    def jump(self, op: int, k: int, true: int | str, false: int | str = 0) -> None:
        """``op`` (JEQ, JGE, JSET) against ``k``: on true to ``true``, else to ``false`` (labels,
        or 0 for the next instruction)."""
        self.code.append((op, true, false, k))

    def ret(self, k: int) -> None:
        self.code.append((_RET_K, 0, 0, k))

    def assemble(self) -> bytes:
        out = []
        for i, (op, jt, jf, k) in enumerate(self.code):
            jt, jf = (self.labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
            if not (0 <= jt <= 255 and 0 <= jf <= 255):
                raise ValueError(f"seccomp jump out of range at instruction {i}")
            out.append(struct.pack("=HBBI", op, jt, jf, k))
        return b"".join(out)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter as bytes of ``struct sock_filter`` for this machine, or None where none is built.

    >>> len(filter_program("x86_64")) % 8, len(filter_program("aarch64")) > 0
    (0, True)
    >>> filter_program("riscv64") is None
    True
    """
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    nr = arch.numbers
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ_K, arch.audit, 0, "eperm")  # another ABI (i386 on x86-64, AArch32 on aarch64)
    p.load(_NR)
    if arch.foreign_from is not None:
        p.jump(_JGE_K, arch.foreign_from, "eperm")
    # clone3 passes its flags in memory a filter cannot read: ENOSYS, and the C library falls
    # back to clone, whose flags it can. A new user namespace is refused (bwrap's
    # --disable-userns does the same where /proc/sys is writable, outside containers).
    p.jump(_JEQ_K, nr["clone3"], "enosys")
    p.jump(_JEQ_K, nr["clone"], "clone")
    p.jump(_JEQ_K, nr["socket"], "socket")
    p.jump(_JEQ_K, nr["socketpair"], "socketpair")
    for name in REFUSED:
        p.jump(_JEQ_K, nr[name], "eperm")
    p.ret(_ALLOW)
    p.label("clone")
    p.load(_ARG0)  # the low half of clone's flags
    p.jump(_JSET_K, _CLONE_NEWUSER, "eperm", "allow")
    p.label("socket")
    p.load(_ARG0)  # the family (an int: the low half is all of it)
    for family in ALLOWED_FAMILIES:
        p.jump(_JEQ_K, family, "allow")
    p.ret(_ERRNO | errno.EAFNOSUPPORT)
    p.label("socketpair")
    p.load(_ARG0)
    p.jump(_JEQ_K, socket.AF_UNIX, "allow", "eafnosupport")
    p.label("allow")
    p.ret(_ALLOW)
    p.label("eperm")
    p.ret(_ERRNO | errno.EPERM)
    p.label("enosys")
    p.ret(_ERRNO | errno.ENOSYS)
    p.label("eafnosupport")
    p.ret(_ERRNO | errno.EAFNOSUPPORT)
    return p.assemble()
