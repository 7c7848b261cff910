"""The seccomp filter of the full tier: system calls through which a job could hold memory that no
rlimit counts, or reach the kernel's riskiest interfaces, fail with EPERM.

RLIMIT_AS bounds each process's mappings, but System V shared memory outlives its mapping (a
segment stays after ``shmdt``), a memfd grows by ``write`` without being mapped, and a POSIX message
queue lives in the kernel: none of them is counted, so a job could fill the host's memory through
them. Refused here too: io_uring, BPF, userfaultfd, perf, keyrings, ptrace and cross-process memory
access (the sandbox has nothing to debug), and new namespaces: ``unshare``, ``setns`` and a
``clone`` that asks for a user namespace (the one kind that needs no capability).

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
_LD_ABS_W, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_EPERM = 0x00050000 | errno.EPERM
_ENOSYS = 0x00050000 | errno.ENOSYS
_CLONE, _CLONE3, _CLONE_NEWUSER = 56, 435, 0x10000000

DENIED_X86_64 = {
    "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
    "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semtimedop": 220,
    "mq_open": 240, "memfd_create": 319, "memfd_secret": 447,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "bpf": 321, "userfaultfd": 323, "perf_event_open": 298,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "unshare": 272, "setns": 308,
}  # fmt: skip
"""System call numbers of x86-64 (arch/x86/entry/syscalls/syscall_64.tbl) refused with EPERM."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter as bytes of ``struct sock_filter`` for this machine, or None where none is built.

    >>> len(filter_program("x86_64")) // 8 == 12 + len(DENIED_X86_64)
    True
    >>> filter_program("aarch64") is None
    True
    """
    if (machine or platform.machine()) != "x86_64":
        return None
    nrs = sorted(DENIED_X86_64.values())
    deny = 9 + len(nrs) + 1  # index of "ret EPERM"; "ret ENOSYS" follows it
    prog = [
        _insn(_LD_ABS_W, 0, 0, 4),  # 0: seccomp_data.arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),  # 1
        _insn(_RET_K, 0, 0, _EPERM),  # 2: another ABI (i386)
        _insn(_LD_ABS_W, 0, 0, 0),  # 3: seccomp_data.nr
        _insn(_JGE_K, deny - 5, 0, _X32_BIT),  # 4: x32 numbers
        # clone3 passes its flags in memory a filter cannot read: ENOSYS, and the C library falls
        # back to clone, whose flags it can. A new user namespace is refused (bwrap's
        # --disable-userns does the same where /proc/sys is writable, outside containers).
        _insn(_JEQ_K, deny + 1 - 6, 0, _CLONE3),  # 5
        _insn(_JEQ_K, 0, 2, _CLONE),  # 6: clone -> 7, else 9
        _insn(_LD_ABS_W, 0, 0, 16),  # 7: the low half of args[0], clone's flags
        _insn(_JSET_K, deny - 9, deny - 9 - 1, _CLONE_NEWUSER),  # 8: -> EPERM, else ALLOW
    ]
    for i, nr in enumerate(nrs):
        prog.append(_insn(_JEQ_K, deny - (9 + i) - 1, 0, nr))
    prog.append(_insn(_RET_K, 0, 0, _ALLOW))
    prog.append(_insn(_RET_K, 0, 0, _EPERM))
    prog.append(_insn(_RET_K, 0, 0, _ENOSYS))
    return b"".join(prog)
