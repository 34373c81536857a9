"""Run untrusted code -- model-written programs, user reward functions -- in a throw-away, limited process.

Parent side (what megarl calls):
  * `run_python(source, stdin, limits, timeout_s)` runs a program, captures stdout/stderr;
  * `call(fn_path, args, limits, timeout_s)` runs one function ("pkg.module:function") and returns its value;
  * `FunctionWorker(fn_path, timeout_s)`: one persistent, *unisolated* process for trusted functions that
    may still hang: a call that overruns its deadline kills the worker, which restarts on the next call;
  * `probe()` says which isolation layers this machine applies;
  * `hide_from_sandboxes(*paths)`: paths (the run's answers and outputs) no sandbox of this process may read.
Child side: this same file run as a script (`python -I sandbox.py`), standard library only, so a
sandbox starts without importing megarl or torch.

The layers that contain sandboxed code, each applied where the kernel allows (docs/security.md,
"Sandbox modes", says what each mode stops and what remains):
  process     its own session and process group; at the wall-clock deadline the group is SIGKILLed.
              A fresh environment (nothing of the sampler's). For call(): the result pipe is
              close-on-exec, replaced by /dev/null in forked children, and the process is non-dumpable,
              so code the function starts cannot write its result.
  rlimits     CPU seconds (SIGXCPU), address space, file size, open files, no POSIX message queues, no
              core dumps; with max_processes > 1 also RLIMIT_NPROC (processes *and threads*).
  seccomp     no_new_privs + a BPF filter: no ptrace, process_vm_readv/writev, SysV shared memory,
              message queues or semaphores, memfd, io_uring (it can open sockets behind seccomp's back);
              with max_processes == 1 no new task at all (fork, vfork, clone, clone3: threads too -- root
              is exempt from RLIMIT_NPROC, and raw clone(CLONE_THREAD) needs almost no address space);
              no socket() when network is off; without a pid namespace, signals and prlimit only to the
              sandbox's own process and group, and no setsid/setpgid (leaving the group escapes its kill).
              Unprivileged, root or not.
  namespaces  an unprivileged user namespace with mount, pid, ipc and net namespaces: every mount
              read-only and nodev except a size-capped tmpfs working directory and /dev/null, the
              paths of hide_from_sandboxes() and the run-secret directories (megarl.secret)
              covered, a fresh /proc that shows only the sandbox, no
              network interface but a down loopback, all capabilities dropped, and every process the
              code starts dies with it.
Without user namespaces (kernel.unprivileged_userns_clone=0, an AppArmor userns restriction, docker's
default seccomp profile) the working directory is a host tempdir (cwd, HOME and TMPDIR point there),
files are limited only by the uid's permissions and nothing is hidden. As root that fallback is refused
(the code would run as root); as another user the sampler makes itself non-dumpable, so the sandbox
(same uid) cannot read its /proc/<pid>/environ or memory. RLIMIT_NPROC does not bind uid 0 (the kernel
exempts root), so as root only max_processes == 1 (seccomp) can be enforced and larger values are refused.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import importlib
import json
import numbers
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parent side imports it where needed: the child runs this file before megarl is importable
    from megarl.config.schema import SandboxConfig


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    error: str | None  # None iff the code ran to completion (call: returned; run_python: exit status 0)
    wall_s: float
    layers: tuple[str, ...] = ()  # the isolation layers that were applied
    value: object = None  # call(): the function's return value (JSON types only)


class SandboxError(RuntimeError):
    """Code run in a child process (a sandbox or a FunctionWorker) failed; the message says how: the limit
    it hit, its exception as "Type: message", or its exit status."""


def load_function(path: str):
    """"package.module:function" -> the function; ValueError naming the path and what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form 'package.module:function'")
    try:
        target = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"{path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{path!r}: {target.__name__ if hasattr(target, '__name__') else target!r} "
                             f"has no attribute {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{path!r} is not callable")
    return target


# ---------------------------------------------------------------------------------------------- parent side

def _limits(**fields) -> SandboxConfig:
    """task.sandbox's limits (defaults, or `fields`); imported here: the child runs this file without megarl."""
    from megarl.config.schema import SandboxConfig

    return SandboxConfig(**fields)


def run_python(source: str, stdin: str = "", limits: SandboxConfig | None = None,
               timeout_s: float = 10.0) -> SandboxResult:
    """Run `source` as a Python 3 program (`__main__`) in the sandbox, with `stdin` as its input."""
    return _run({"mode": "exec", "source": source, "stdin": stdin}, limits or _limits(), timeout_s)


def call(fn_path: str, args: list, limits: SandboxConfig | None = None, timeout_s: float = 10.0) -> object:
    """`fn(*args)` in the sandbox; its JSON-typed return value, or SandboxError saying why not."""
    result = _run({"mode": "call", "fn": fn_path, "args": args}, limits or _limits(), timeout_s)
    if result.error is not None:
        raise SandboxError(result.error)
    return result.value


@functools.lru_cache(maxsize=None)
def probe() -> tuple[str, ...]:
    """The isolation layers a sandbox gets on this machine (runs an empty program once per process)."""
    result = run_python("", limits=_limits(require_namespaces=False), timeout_s=30.0)
    if result.error is not None:
        raise SandboxError(f"the sandbox cannot run on this machine: {result.error}")
    return result.layers


_hidden_paths: tuple[str, ...] = ()


def hide_from_sandboxes(*paths: str) -> None:
    """Paths no sandbox this process starts may read: the run's answers (task.path), its run and
    checkpoint directories. Process-wide, because rewards, tasks and tools all start sandboxes and must
    hide the same run-level paths; set by a role at start. Each existing path is covered, in the
    sandbox's mount namespace, by an empty read-only tmpfs (a directory) or an unreadable node (a file);
    a path that holds the sandbox's working directory or an import path it needs is left visible (hiding
    it would break the sandbox) and named in the result's layers. Without namespaces nothing is hidden."""
    global _hidden_paths
    _hidden_paths = tuple(dict.fromkeys(os.path.realpath(os.path.expanduser(p)) for p in paths if p))


def _child_argv() -> list[str]:
    # -I: no user site, no PYTHON* variables, no script directory on sys.path; the child sets sys.path.
    return [sys.executable, "-I", os.path.abspath(__file__)]


def _sys_path() -> list[str]:
    """The import path of a dotted function in the child: the parent's working directory first, then the
    parent's own path (PYTHONPATH, installed packages). The working directory is added explicitly because
    whether it is on the parent's path depends on how the parent started (`python -m` yes, the `megarl`
    console script no); this way `megarl train`'s check and every sampler resolve a function alike."""
    paths = [os.getcwd(), *(os.path.abspath(p or os.getcwd()) for p in sys.path)]
    return list(dict.fromkeys(paths))


def _child_env(workdir: str) -> dict[str, str]:
    # A fresh environment: nothing of the sampler's (tokens, credentials) reaches the code. One thread per
    # math library: with max_processes=1 seccomp refuses every thread, and OpenBLAS (numpy) dies by SIGINT
    # at import when it cannot start its thread pool.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=None)
def _hide_from_own_uid() -> None:
    """Make this process non-dumpable: without namespaces the sandbox runs as this uid and sees host
    /proc, and a same-uid process without capabilities may otherwise read /proc/<this pid>/environ
    (tokens, credentials), open /proc/<this pid>/mem or ptrace it. Costs: no core dumps; profilers
    such as py-spy need root to attach."""
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")


def _run(job: dict, limits: SandboxConfig, timeout_s: float) -> SandboxResult:
    limits.check()
    if not limits.require_namespaces and os.geteuid() != 0:
        _hide_from_own_uid()
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="megarl-sandbox-")
    result_r, result_w = os.pipe()
    from megarl.secret import secret_dirs  # here: the child runs this file before megarl is importable

    spec = {**job, "workdir": workdir, "result_fd": result_w, "limits": asdict(limits), "sys_path": _sys_path(),
            "hidden": _hidden_paths, "secrets": secret_dirs()}
    try:
        proc = subprocess.Popen(_child_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=workdir, env=_child_env(workdir),
                                start_new_session=True, pass_fds=(result_w,))
    except BaseException:
        os.close(result_r)
        _remove_tree(workdir)
        raise
    finally:
        os.close(result_w)
    try:
        streams, stop = _pump(proc, result_r, (json.dumps(spec) + "\n").encode(), start + timeout_s,
                              limits.max_output_kb * 1024)
        if stop == "timeout" and proc.poll() is not None:  # its output held open by a process it started
            stop = "timeout:orphan"
        if stop is None:
            try:
                proc.wait(max(0.0, start + timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop = "timeout"
    finally:
        _kill_group(proc)  # also whatever the code left running in its process group
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
        os.close(result_r)
        _remove_tree(workdir)
    stdout, stderr, records = (streams[k].decode("utf-8", "replace") for k in ("stdout", "stderr", "result"))
    record: dict = {}
    lines = records.splitlines()  # {"layers": [...]}, then (call) {"value": v} or {"error": "..."}
    expected = 2 if job["mode"] == "call" else 1
    for line in lines[:expected]:
        try:
            record.update(json.loads(line))
        except ValueError:
            record["error"] = f"unreadable result record {line[:80]!r}"
    if len(lines) > expected:  # the sandbox writes no more; a forged value must not count
        record.pop("value", None)
        record["error"] = (f"the result channel carried {len(lines)} records, more than the sandbox writes "
                           f"({lines[expected][:80]!r}): something else in the sandbox wrote to it")
    result = SandboxResult(returncode=proc.returncode, stdout=stdout, stderr=stderr, error=record.get("error"),
                           wall_s=time.monotonic() - start, layers=tuple(record.get("layers", ())),
                           value=record.get("value"))
    result.error = _describe_failure(result, stop, limits, timeout_s, job["mode"], "value" in record)
    return result


def _pump(proc: subprocess.Popen, result_r: int, payload: bytes, deadline: float,
          cap: int) -> tuple[dict[str, bytearray], str | None]:
    """Feed `payload` to the child's stdin and collect stdout, stderr and the result pipe until all three
    close. Returns the bytes and why collection stopped early ("timeout", "output:<stream>") or None."""
    streams = {"stdout": bytearray(), "stderr": bytearray(), "result": bytearray()}
    with selectors.DefaultSelector() as sel:  # epoll: the sampler may hold more than 1024 fds
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        sel.register(result_r, selectors.EVENT_READ, "result")
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
        pending = memoryview(payload)
        while len(sel.get_map()) > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return streams, "timeout"
            for key, _ in sel.select(remaining):
                if key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except BrokenPipeError:  # the child died before reading its job
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                streams[key.data] += chunk
                if len(streams[key.data]) > cap:
                    return streams, f"output:{key.data}"
    return streams, None


def _describe_failure(result: SandboxResult, stop: str | None, limits: SandboxConfig, timeout_s: float,
                      mode: str, returned: bool) -> str | None:
    if stop == "timeout":
        return f"wall-clock limit: still running after {timeout_s:g}s (killed)"
    if stop == "timeout:orphan":
        return (f"wall-clock limit: the program ended, but a process it started still held its output after "
                f"{timeout_s:g}s (killed with the sandbox's process group)")
    if stop is not None:
        return f"output limit: more than {limits.max_output_kb} KiB on {stop.split(':')[1]} (killed)"
    rc = result.returncode
    # Death by signal: a negative status, or 128 + signal when pid 1 of the pid namespace relayed it.
    sig = -rc if rc < 0 else rc - 128 if rc > 128 and "pid-namespace" in result.layers else 0
    if sig == signal.SIGXCPU:
        return f"CPU-time limit: used more than {limits.cpu_s:g}s of CPU (SIGXCPU)"
    if sig == signal.SIGKILL:
        return (f"killed by SIGKILL: the CPU-time hard limit ({limits.cpu_s:g}s + 1), out of memory (the kernel's "
                f"OOM killer), or a kill from within the sandbox")
    if sig in signal.valid_signals():
        return f"killed by {signal.Signals(sig).name}"
    if result.error is not None:
        return result.error
    if rc != 0:
        last = result.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        return f"exit status {rc}: {last[0][:300]}"
    if mode == "call" and not returned:
        return "the function returned nothing to the sandbox (its result record is missing)"
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, failed, _exc):
        # Code may have left a directory without write/execute bits; restore them and retry once.
        os.chmod(os.path.dirname(failed), 0o700)
        if os.path.isdir(failed):
            os.chmod(failed, 0o700)
        func(failed)

    shutil.rmtree(path, onerror=make_writable_and_retry)


# A FunctionWorker child's start-up: a Python process and one import, seconds even on a loaded machine; a minute
# means the import itself hangs.
START_TIMEOUT_S = 60.0


class FunctionWorker:
    """`fn(*args)` in one persistent, unisolated child process, with a deadline per call.

    For trusted functions that must still not stall the caller (a user reward that hangs on some
    input): the child imports the function once, so a call costs a pipe round trip, not a process.
    A call that overruns `timeout_s` kills the child (TimeoutError); the next call starts a new one.
    A new child's start-up (Python, importing the function) has its own deadline, START_TIMEOUT_S: it
    is not the function's time, and a loaded machine must not fail the first call after a restart.
    The child leads its own process group, and the group -- with every process the function started --
    is killed when the worker is closed, when its stdin closes, and when its parent dies however it
    exits (PR_SET_PDEATHSIG with SIGTERM, on which the worker kills its group; the signal fires when
    the creating *thread* exits, so create and call a worker from one long-lived thread). A process
    the function starts in a new session of its own (setsid) leaves the group and is not reached.
    """

    def __init__(self, fn_path: str, timeout_s: float):
        self.fn_path, self.timeout_s = fn_path, timeout_s
        self.proc: subprocess.Popen | None = None
        self.result_r: int | None = None
        self.buffer = b""

    def _start(self) -> None:
        result_r, result_w = os.pipe()
        spec = {"mode": "serve", "fn": self.fn_path, "result_fd": result_w, "sys_path": _sys_path(),
                "parent_pid": os.getpid()}
        try:
            self.proc = subprocess.Popen(_child_argv(), stdin=subprocess.PIPE, start_new_session=True,
                                         pass_fds=(result_w,))
        except BaseException:
            os.close(result_r)
            raise
        finally:
            os.close(result_w)
        self.result_r, self.buffer = result_r, b""
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        self._read_record(START_TIMEOUT_S, f"its worker process did not import {self.fn_path} within "
                                           f"{START_TIMEOUT_S:g}s")  # {"ready": true}, or the import's error

    def __call__(self, *args):
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()
        try:
            self.proc.stdin.write((json.dumps(list(args)) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child died; reading below reports it
        return self._read_record(self.timeout_s, f"{self.fn_path} did not return within {self.timeout_s:g}s")["value"]

    def _read_record(self, timeout_s: float, overrun: str) -> dict:
        """The child's next result line, within timeout_s (else the child is killed: TimeoutError(overrun))."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not _wait_readable(self.result_r, remaining):
                self.close()
                raise TimeoutError(f"{overrun} (its worker process was killed; the next call starts a new one)")
            chunk = os.read(self.result_r, 65536)
            if not chunk:
                rc = self.proc.wait()
                self.close()
                raise SandboxError(f"{self.fn_path}: its worker process exited with status {rc} during the call")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        record = json.loads(line)
        if "error" in record:
            raise SandboxError(record["error"])
        return record

    def close(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc.wait()
            self.proc.stdin.close()
            self.proc = None
        if self.result_r is not None:
            os.close(self.result_r)
            self.result_r = None

    def __del__(self):
        self.close()


def _wait_readable(fd: int, timeout_s: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout_s))


# ----------------------------------------------------------------------------------------------- child side

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 38, 47
SECCOMP_MODE_FILTER, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 2, 0x7FFF0000, 0x00050000

# audit arch, and the syscall numbers the filter needs (aarch64 has no fork/vfork syscalls).
_SYSCALLS = {
    "x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435, "socket": 41,
                            "io_uring_setup": 425, "ptrace": 101, "process_vm_readv": 310,
                            "process_vm_writev": 311, "shmget": 29, "shmat": 30, "msgget": 68, "semget": 64,
                            "memfd_create": 319, "memfd_secret": 447, "kill": 62, "tkill": 200, "tgkill": 234,
                            "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "pidfd_open": 434,
                            "pidfd_send_signal": 424, "pidfd_getfd": 438, "prlimit64": 302, "setsid": 112,
                            "setpgid": 109}),
    "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "socket": 198, "io_uring_setup": 425, "ptrace": 117,
                             "process_vm_readv": 270, "process_vm_writev": 271, "shmget": 194, "shmat": 196,
                             "msgget": 186, "semget": 190, "memfd_create": 279, "memfd_secret": 447, "kill": 129,
                             "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
                             "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "prlimit64": 261,
                             "setsid": 157, "setpgid": 154}),
}
# Always denied: another process's memory (ptrace, process_vm_*), and memory that outlives or escapes
# RLIMIT_AS (SysV shared memory and message queues, detached, stay allocated; memfd pages count against
# no limit until mapped).
_ALWAYS_DENIED = ("io_uring_setup", "ptrace", "process_vm_readv", "process_vm_writev", "shmget", "shmat", "msgget",
                  "semget", "memfd_create", "memfd_secret")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    # mountinfo escapes space, tab, newline and backslash as octal.
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points]


def _remount_readonly(point: str) -> None:
    """Make one mount read-only and nodev, keeping the flags a user namespace may not change."""
    try:
        have = os.statvfs(point).f_flag
    except OSError:
        return  # overmounted or vanished: not reachable by path, so nothing to protect
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= MS_NOEXEC if have & os.ST_NOEXEC else 0
    flags |= MS_NODIRATIME if have & os.ST_NODIRATIME else 0
    if have & os.ST_NOATIME:
        flags |= MS_NOATIME
    elif have & os.ST_RELATIME:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    _mount(None, point, None, flags)


def _hide(paths: list[str], needed: list[str]) -> list[str]:
    """Cover each existing path of `paths` (see hide_from_sandboxes) unless one of `needed` lies in it;
    returns the layer names: "hidden:<path>" or "visible:<path>" (needed, so left readable)."""
    layers = []
    for path in paths:
        if not os.path.lexists(path):
            continue
        if any(os.path.commonpath([path, os.path.realpath(n)]) == path for n in needed):
            layers.append(f"visible:{path}")
        elif os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555")
            layers.append(f"hidden:{path}")
        else:  # a file: /dev/null over it, which the read-only remount below makes nodev (unopenable)
            _mount("/dev/null", path, None, MS_BIND)
            layers.append(f"hidden:{path}")
    return layers


def _enter_namespaces(workdir: str, limits: dict, hidden: list[str], needed: list[str],
                      secrets: list[str] = ()) -> list[str] | None:
    """User + mount + pid + ipc (+ net) namespaces with a read-only view of the filesystem and `hidden` and
    `secrets` (the run-secret directories: always, whatever the run named) covered; returns _hide's layer
    names (for `secrets` only a `visible:` one: whether they exist depends on earlier runs), or None if the
    kernel refuses an unprivileged user namespace and they are not required. Raises if they are required but
    refused, or if setting them up half-succeeds: the sandbox fails closed."""
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if limits["network"] else CLONE_NEWNET)
    if _libc.unshare(flags) != 0:
        if limits["require_namespaces"]:
            err = ctypes.get_errno()
            raise OSError(err, f"this kernel refuses an unprivileged user namespace (unshare: {os.strerror(err)}); "
                               f"set sandbox.require_namespaces=false to run with the process, rlimit and seccomp "
                               f"layers only (writes outside the working directory are then limited only by file "
                               f"permissions)")
        if os.geteuid() == 0:
            err = ctypes.get_errno()
            raise OSError(err, f"this kernel refuses a user namespace (unshare: {os.strerror(err)}) and megarl runs "
                               f"as root: without one, sandboxed code would run as root (it could write any root-owned "
                               f"file and signal any root process), so sandbox.require_namespaces=false is refused "
                               f"for uid 0; allow user namespaces or run megarl as a non-root user (docs/security.md)")
        return None
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['disk_mb']}m,mode=0700")
    _mount("/dev/null", "/dev/null", None, MS_BIND)  # its own mount, so it survives /dev going nodev
    hide_layers = _hide(hidden, [workdir, *needed])
    hide_layers += [layer for layer in _hide(list(secrets), [workdir, *needed]) if layer.startswith("visible:")]
    for point in _mount_points():
        if point not in (workdir, "/dev/null"):
            _remount_readonly(point)
    return hide_layers


def _fork_and_mirror() -> None:
    """Fork; the child returns, this process waits for it and then exits the way it did. The child dies
    with this process (PR_SET_PDEATHSIG)."""
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if _wait_readable(alive_r, 0):  # EOF: the parent died before PDEATHSIG was armed
            os._exit(137)
        os.close(alive_r)
        return
    os.close(alive_r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot have a handler (EINVAL)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # still here: pid 1 of a namespace cannot signal itself; exit as a shell would
    os._exit(os.waitstatus_to_exitcode(status))


def _enter_pid_namespace() -> None:
    """Become pid 2 of the pid namespace unshared before. Pid 1 only waits: when it exits, the kernel
    kills everything left in the namespace. The code must not be pid 1 itself, because pid 1 ignores
    signals it has no handler for -- SIGXCPU from RLIMIT_CPU included."""
    _fork_and_mirror()  # now pid 1
    _fork_and_mirror()  # now pid 2


def _hide_host_proc() -> None:
    try:  # a /proc of the new pid namespace: host processes (and their environments) are invisible
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError:
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")


def _drop_capabilities() -> None:
    """Give up the capabilities the user namespace granted (bounding, ambient, then effective/permitted)."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    _libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0))  # _LINUX_CAPABILITY_VERSION_3
    _check(_libc.capset(header, ctypes.create_string_buffer(24)), "capset")


def _set_rlimits(limits: dict) -> None:
    cpu = int(-(-limits["cpu_s"] // 1))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = limits["disk_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # POSIX message queues: kernel memory outside RLIMIT_AS
    if limits["max_processes"] > 1:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))


def _seccomp_program(arch: str, deny_processes: bool, deny_network: bool,
                     own_pid: int | None = None) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jt, jf, k) instructions. deny_processes: no new task at all, process or
    thread (RLIMIT_NPROC cannot bound threads for root, and a raw clone(CLONE_THREAD) needs almost no
    address space). own_pid (set where host processes are visible: no pid namespace): signals and
    prlimit reach only this process and its process group, never another pid."""
    audit_arch, nr = _SYSCALLS[arch]
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    load = lambda offset: (0x20, 0, 0, offset)  # noqa: E731  BPF_LD|BPF_W|BPF_ABS
    ret = lambda action: (0x06, 0, 0, action)  # noqa: E731  BPF_RET|BPF_K
    denied = {nr[name]: eperm for name in _ALWAYS_DENIED}
    if deny_network:
        denied[nr["socket"]] = eperm
    if deny_processes:
        denied.update({nr[name]: eperm for name in ("fork", "vfork", "clone") if name in nr})
        denied[nr["clone3"]] = enosys  # ENOSYS makes glibc fall back to clone(), denied above
    allowed_first_arg: dict[int, tuple[int, ...]] = {}
    if own_pid is not None:
        # setsid / setpgid too: a process that left the sandbox's process group would outlive its SIGKILL (no pid
        # namespace here ends it with the sandbox's init)
        denied.update({nr[name]: eperm for name in ("tkill", "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
                                                    "setsid", "setpgid")})
        group = (0, own_pid, -own_pid & 0xFFFFFFFF)  # kill(0)/kill(-pgid): the own group (pgid == own_pid)
        allowed_first_arg = {nr["kill"]: group, nr["rt_sigqueueinfo"]: group, nr["tgkill"]: (own_pid,),
                             nr["rt_tgsigqueueinfo"]: (own_pid,), nr["prlimit64"]: (0, own_pid)}
    program = [load(4), (0x15, 1, 0, audit_arch), ret(eperm), load(0)]  # another ABI (i386 on x86_64): deny
    if arch == "x86_64":
        program += [(0x35, 0, 1, 0x40000000), ret(eperm)]  # x32 syscalls (nr | 0x40000000): deny
    for number, action in denied.items():
        program += [(0x15, 0, 1, number), ret(action)]  # BPF_JEQ
    for number, values in allowed_first_arg.items():
        # args[0]'s low 32 bits (pid_t; little-endian): allowed values return ALLOW, anything else EPERM.
        block = [load(16)] + [ins for v in values for ins in ((0x15, 0, 1, v), ret(SECCOMP_RET_ALLOW))] + [ret(eperm)]
        program += [(0x15, 0, len(block), number)] + block
    return program + [ret(SECCOMP_RET_ALLOW)]


def _install_seccomp(limits: dict, own_pid: int | None) -> bool:
    arch = platform.machine()
    if arch not in _SYSCALLS:
        return False

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    program = _seccomp_program(arch, limits["max_processes"] == 1, not limits["network"], own_pid)
    filters = (SockFilter * len(program))(*[SockFilter(*ins) for ins in program])
    fprog = SockFprog(len(program), filters)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(SECCOMP)")
    return True


def _isolate(spec: dict) -> list[str]:
    """Apply every layer this kernel allows, in the order that keeps each one possible; returns their names."""
    limits, workdir = spec["limits"], spec["workdir"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    layers = ["process"]
    # The interpreter and, for a function, its import path stay visible whatever is hidden.
    needed = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.abspath(__file__))]
    needed += spec["sys_path"] if spec["mode"] == "call" else []
    hide_layers = _enter_namespaces(workdir, limits, spec["hidden"], needed, spec["secrets"])
    namespaced = hide_layers is not None
    if namespaced:
        _enter_pid_namespace()  # returns in pid 1 of the new namespace
        _hide_host_proc()
        _drop_capabilities()
        layers += ["namespaces", "readonly-fs", "tmpfs-workdir", "pid-namespace"]
        layers += [] if limits["network"] else ["net-namespace"]
        layers += hide_layers
    os.chdir(workdir)
    _set_rlimits(limits)
    layers.append("rlimits")
    # Without a pid namespace every host process is addressable by pid: signals stay within this process
    # and its group (it is the group's leader: start_new_session).
    if _install_seccomp(limits, None if namespaced else os.getpid()):
        layers.append("seccomp")
    return layers


def describe_exception(exc: BaseException) -> str:
    """"Type: message (at FILE:LINE in FUNCTION)": the exception and the innermost frame of the code that
    raised it (frames of this file, which only called it, are skipped; none left: no location)."""
    import traceback

    text = f"{type(exc).__name__}: {exc}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != os.path.abspath(__file__)
              and f.filename != __file__]
    return f"{text} (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else text


def _encode_value(value) -> dict:
    """A JSON record of a function's result; anything but plain data is reported by type, never pickled
    (unpickling would run code chosen by the sandboxed side in the parent)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, numbers.Real):  # numpy scalars (np.int64, np.float32, ...) register as numbers.Real
        return {"value": bool(value) if type(value).__name__ == "bool_" else float(value)}
    return {"error": f"TypeError: result must be a number, got {type(value).__name__} {repr(value)[:80]}"}


def _kill_own_group(*_signal) -> None:
    """SIGKILL this worker's whole process group: the function's children with it (the worker leads
    the group: start_new_session)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _serve(spec: dict, out) -> None:
    # The parent's death (even by SIGKILL, or a rank's os._exit, which runs no cleanup) sends SIGTERM,
    # on which the worker kills its group: whatever the function started dies with the run.
    signal.signal(signal.SIGTERM, _kill_own_group)
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != spec["parent_pid"]:
        _kill_own_group()  # the parent died before PDEATHSIG was armed
    try:
        fn = load_function(spec["fn"])
    except ValueError as exc:
        out.write(json.dumps({"error": f"ValueError: {exc}"}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")  # the calls' deadlines start after this (FunctionWorker)
    try:
        for line in sys.stdin:
            try:
                record = _encode_value(fn(*json.loads(line)))
            except Exception as exc:  # noqa: BLE001 - reported to the caller, who records it
                record = {"error": describe_exception(exc)}
            out.write(json.dumps(record) + "\n")
    finally:  # stdin closed: the parent is done with this worker
        out.flush()
        _kill_own_group()


def _seal_result_channel(fd: int) -> None:
    """Keep the result pipe (already close-on-exec) from every process this one starts from now on: in a
    forked child it is replaced by /dev/null (so the child's writes, and Python's closing of the inherited
    file object, go nowhere), and the process is made non-dumpable, so its children (same uid, no
    capabilities) cannot reach it through ptrace, process_vm_*, /proc/<pid>/fd or /proc/<pid>/mem either."""
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")

    def blank() -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd, inheritable=False)
        os.close(null)

    os.register_at_fork(after_in_child=blank)


def _child_main() -> None:
    spec = json.loads(sys.stdin.buffer.readline())
    sys.path[:] = spec["sys_path"]
    sys.dont_write_bytecode = True
    result_fd = spec.pop("result_fd")
    os.set_inheritable(result_fd, False)
    out = os.fdopen(result_fd, "w", buffering=1)
    if spec["mode"] == "serve":
        _seal_result_channel(result_fd)
        _serve(spec, out)
        return
    try:
        layers = _isolate(spec)  # forks (pid namespace) before the channel is sealed against forked children
        if spec["mode"] == "call":  # ("exec" closes the channel before the program starts)
            _seal_result_channel(result_fd)
        if spec["mode"] == "exec":
            with open("main.py", "w") as f:
                f.write(spec["source"])
            with open("stdin.txt", "w") as f:
                f.write(spec["stdin"])
            fd = os.open("stdin.txt", os.O_RDONLY)
            os.dup2(fd, 0)
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - fail closed: no code runs in a half-built sandbox
        out.write(json.dumps({"error": f"sandbox setup failed: {type(exc).__name__}: {exc}"}) + "\n")
        sys.exit(1)
    out.write(json.dumps({"layers": layers}) + "\n")
    if spec["mode"] == "exec":
        out.close()
        import runpy

        sys.stdin = open(0, closefd=False)
        sys.argv = ["main.py"]
        sys.path.insert(0, spec["workdir"])  # as for `python main.py`: the script's directory first
        runpy.run_path("main.py", run_name="__main__")
        return
    try:
        record = _encode_value(load_function(spec["fn"])(*spec["args"]))
    except Exception as exc:  # noqa: BLE001
        record = {"error": describe_exception(exc)}
    out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    _child_main()
