"""The project's own seccomp profile: the system calls a Python sandbox uses, and nothing else.

Every container gets it, whatever the engine's version: older engines' default profiles still
allow io_uring, and Docker's default allows much a data-science sandbox never needs. Calls not
listed fail with EPERM; ``clone3`` and io_uring fail with ENOSYS, so libraries fall back to the
older calls instead of failing. Only the native 64-bit ABI is allowed (no 32-bit entry points).

Under gVisor the profile is applied inside the sandbox only when runsc runs with
``--oci-seccomp`` (``scripts/ensure-docker.sh`` registers it so; ``doctor`` checks). gVisor turns
every refusal into EPERM, so glibc would not fall back from ``clone3`` to ``clone``: there,
``clone3`` is allowed (gVisor's own kernel serves it; the host's is not involved). Older gVisor
releases name some calls differently (Debian's 2022 runsc knows ``pselect6`` as ``pselect``);
their names are added as aliases, measured by calling every syscall under both profiles.

Left out on purpose (each has been an exploitation primitive, and no library here needs it):
io_uring (a large kernel surface, ENOSYS), userfaultfd (stalls kernel code at will), ptrace,
process_vm_readv/writev, kcmp and pidfd_getfd (reaching into other processes), Linux AIO,
inotify instances (a per-uid host-wide count), internet sockets when there is no network,
vmsplice and tee, keyrings, bpf, perf_event_open, namespaces and mounts (unshare, setns, clone
with CLONE_NEW* flags, mount), memory policy calls, modify_ldt, personality changes, and the
calls Docker reserves for capabilities the sandbox does not have.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

EPERM = 1
ENOSYS = 38
CLONE_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
PERSONALITY_QUERY = 0xFFFFFFFF

ALLOWED: dict[str, tuple[str, ...]] = {
    "files": (
        "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
        "open", "openat", "openat2", "creat", "close", "close_range", "lseek", "stat", "fstat", "lstat",
        "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2", "readlink",
        "readlinkat", "getdents", "getdents64", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename",
        "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod", "fchmod", "fchmodat",
        "fchmodat2", "chown", "fchown", "lchown", "fchownat", "truncate", "ftruncate", "fallocate", "fsync",
        "fdatasync", "sync", "syncfs", "sync_file_range", "fadvise64", "readahead", "utime", "utimes",
        "utimensat", "futimesat", "umask", "chdir", "fchdir", "getcwd", "mknod", "mknodat", "flock", "fcntl",
        "dup", "dup2", "dup3", "pipe", "pipe2", "sendfile", "copy_file_range", "splice", "getxattr",
        "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr", "setxattr", "lsetxattr",
        "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "inotify_add_watch", "inotify_rm_watch",
        "ioctl", "memfd_create",
    ),
    "memory": (
        "brk", "mmap", "munmap", "mprotect", "mremap", "msync", "madvise", "mincore", "mlock", "mlock2",
        "munlock", "mlockall", "munlockall", "membarrier",
    ),
    "processes": (
        "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid", "kill", "tkill",
        "tgkill", "getpid", "getppid", "gettid", "getpgid", "setpgid", "getpgrp", "getsid", "setsid",
        "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "futex", "futex_waitv", "prctl",
        "arch_prctl", "pidfd_open", "pidfd_send_signal", "restart_syscall", "seccomp", "getrandom",
    ),
    "identity": (
        "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid", "setgid",
        "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capget",
        "capset",
    ),
    "scheduling and limits": (
        "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam",
        "sched_getscheduler", "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min",
        "sched_rr_get_interval", "sched_getattr", "sched_setattr", "getpriority", "setpriority", "getrlimit",
        "setrlimit", "prlimit64", "getrusage", "times", "sysinfo", "uname", "getcpu", "ioprio_get",
    ),
    "time": (
        "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time", "alarm",
        "pause", "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime",
        "timer_getoverrun", "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    ),
    "signals": (
        "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend", "rt_sigtimedwait",
        "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sigaltstack", "signalfd", "signalfd4",
    ),
    "waiting": (
        "select", "pselect6", "poll", "ppoll", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
        "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    ),
    "sockets": (
        "socketpair", "bind", "listen", "accept", "accept4", "connect", "getsockname", "getpeername",
        "getsockopt", "setsockopt", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
        "shutdown",
    ),
    "ipc": (
        "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
        "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
        "mq_getsetattr",
    ),
}  # fmt: skip
# inotify instances are counted per uid across the whole host (every sandbox is uid 1000): one
# tenant holding them would starve the others. Libraries that watch files fall back to polling.
NOT_IMPLEMENTED = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register", "inotify_init", "inotify_init1")
EAFNOSUPPORT = 97
INET_FAMILIES = ("AF_INET", "AF_INET6")
GVISOR_ALIASES = {"pselect6": "pselect"}


def _arg(index: int, value: int, op: str = "SCMP_CMP_EQ", value_two: int = 0) -> dict[str, Any]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


@cache
def profile(runtime: str | None = None, *, network: bool = False) -> dict[str, Any]:
    """The profile for ``runtime``. Without a network, internet sockets are refused too: all they
    could reach is loopback, whose socket buffers the kernel charges to no container's memory
    (one sandbox could exhaust the host's TCP memory), and whose ports outlive a run."""
    allowed = {name for names in ALLOWED.values() for name in names}
    not_implemented = list(NOT_IMPLEMENTED)
    if runtime == "runsc":
        allowed.add("clone3")
        not_implemented.remove("clone3")
        allowed |= {alias for name, alias in GVISOR_ALIASES.items() if name in allowed}
    rules: list[dict[str, Any]] = [
        {"names": sorted(allowed), "action": "SCMP_ACT_ALLOW"},
        {"names": not_implemented, "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        # clone without namespace flags: threads and forks, never new namespaces
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [_arg(0, CLONE_NAMESPACE_FLAGS, "SCMP_CMP_MASKED_EQ")],
        },
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [_arg(0, 0)]},
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [_arg(0, PERSONALITY_QUERY)]},
    ]
    for name, family in SOCKET_FAMILIES.items():  # rules for one call are alternatives
        refused = name in INET_FAMILIES and not network
        action = {"action": "SCMP_ACT_ERRNO", "errnoRet": EAFNOSUPPORT} if refused else {"action": "SCMP_ACT_ALLOW"}
        rules.append({"names": ["socket"], **action, "args": [_arg(0, family)]})
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "archMap": [
            {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": []},
            {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": []},
        ],
        "syscalls": rules,
    }


@cache
def profile_json(runtime: str | None = None, *, network: bool = False) -> str:
    """The profile as the engine takes it (``security_opt: seccomp=<json>``)."""
    return json.dumps(profile(runtime, network=network), separators=(",", ":"))
