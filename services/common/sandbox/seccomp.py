"""The seccomp filter of the full tier: system calls through which a job could hold memory that no
rlimit counts, or reach the kernel's riskiest interfaces, fail with EPERM.

RLIMIT_AS bounds each process's mappings, but System V shared memory outlives its mapping (a
segment stays after ``shmdt``), a memfd grows by ``write`` without being mapped, and a POSIX message
queue lives in the kernel: none of them is counted, so a job could fill the host's memory through
them. Refused here too: io_uring, BPF, userfaultfd, perf, keyrings, ptrace and cross-process memory
access (the sandbox has nothing to debug). Namespaces and mounts are refused already (no
capabilities, ``--disable-userns``).

A classic BPF program built here (no libseccomp for the service's interpreter), handed to bwrap
with ``--seccomp FD``; bwrap installs it, with no-new-privs, just before it runs the job. x86-64
only: on another architecture :func:`filter_program` returns None and the job runs without it (the
probe's memory bound then rests on RLIMIT_AS alone). Any other ABI on x86-64 (i386 ``int 0x80``,
x32) is refused whole, so the numbers below cannot be dodged.
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_LD_ABS_W, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW = 0x7FFF0000
_EPERM = 0x00050000 | errno.EPERM

DENIED_X86_64 = {
    "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
    "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semtimedop": 220,
    "mq_open": 240, "memfd_create": 319, "memfd_secret": 447,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "bpf": 321, "userfaultfd": 323, "perf_event_open": 298,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
}  # fmt: skip
"""System call numbers of x86-64 (arch/x86/entry/syscalls/syscall_64.tbl) refused with EPERM."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter as bytes of ``struct sock_filter`` for this machine, or None where none is built.

    >>> len(filter_program("x86_64")) // 8 == 7 + len(DENIED_X86_64)
    True
    >>> filter_program("aarch64") is None
    True
    """
    if (machine or platform.machine()) != "x86_64":
        return None
    nrs = sorted(DENIED_X86_64.values())
    deny = 6 + len(nrs)  # index of the final "ret EPERM"
    prog = [
        _insn(_LD_ABS_W, 0, 0, 4),  # seccomp_data.arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _EPERM),  # another ABI (i386)
        _insn(_LD_ABS_W, 0, 0, 0),  # seccomp_data.nr
        _insn(_JGE_K, deny - 5, 0, _X32_BIT),  # x32 numbers
    ]
    for i, nr in enumerate(nrs):
        prog.append(_insn(_JEQ_K, deny - (5 + i) - 1, 0, nr))
    prog.append(_insn(_RET_K, 0, 0, _ALLOW))
    prog.append(_insn(_RET_K, 0, 0, _EPERM))
    return b"".join(prog)
