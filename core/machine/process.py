"""Process control for the programs Warmslot starts: own group, polite stop, then kill all.

llama-server, its smoke starts and the build's cmake/compilers are each started as
the leader of their own group, so that stopping one also stops whatever it started
and nothing outlives Warmslot. One implementation, a branch per OS:

* **POSIX** — the child starts a new session (``start_new_session``), so its pid is
  its process-group id and its session id. A stop is ``SIGTERM`` to the group, a kill
  ``SIGKILL`` to the group (``os.killpg``) and to every other process of the session:
  ninja runs each build command in a process group of its own (so that a terminal's
  Ctrl-C reaches ninja alone), in the same session, and a kill of the group alone
  left those compiling. The group and session ids stay valid while any member
  lives, so both can be killed even after the leader exited (helpers it left behind).
* **Windows** — there are no process groups to signal. The child starts in a new
  console process group (``CREATE_NEW_PROCESS_GROUP``), which makes it the target
  of ``CTRL_BREAK_EVENT``: the polite stop. Without a shared console (the tray app
  has none) that event cannot be sent, and the stop goes straight to the kill. A
  kill walks the process tree with psutil and kills every process in it. A tree is
  found through its living leader: helpers orphaned by a leader that already exited
  are out of reach there (a Job Object would hold them; not done).

Nothing outlives Warmslot, even a ``kill -9`` of it (POSIX): `spawn` starts, beside
each child, a small ``/bin/sh`` watch in a session of its own that holds the read end
of a pipe whose write end only Warmslot holds. When Warmslot's process ends, however
it ends, the kernel closes that end; the watch reads end-of-file and stops the
child's group (``SIGTERM``, then ``SIGKILL`` after `WATCH_GRACE_S`). Once the child
has exited and its group is dealt with (`kill_leftovers`, which `stop_group` ends
with), the watch is told so and leaves quietly. No Python runs in a forked child
(no ``preexec_fn``): the process forks from a threaded one, and CPython documents
that code run between fork and exec there can deadlock (a lock another thread held
at the fork stays locked in the child for ever); ``PR_SET_PDEATHSIG`` set through
ctypes in a ``preexec_fn``, which this replaces, was such code.

Every function is safe to call on a process that is already gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import psutil

__all__ = [
    "WATCH_GRACE_S",
    "ask_to_stop",
    "kill_group",
    "kill_leftovers",
    "new_group_kwargs",
    "spawn",
    "stop_group",
    "wait_exit",
]

log = logging.getLogger("warmslot.server")

# The branch taken; a module attribute so the tests can take the Windows branch here.
_WINDOWS = os.name == "nt"
# The Windows-only constants, by value, so this module imports (and type-checks) anywhere.
_CREATE_NEW_PROCESS_GROUP = int(getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x00000200))
_CTRL_BREAK_EVENT = int(getattr(signal, "CTRL_BREAK_EVENT", 1))
# How often an exit is checked for (see `wait_exit`).
_POLL_S = 0.05


class GroupKwargs(TypedDict, total=False):
    """The one keyword argument `new_group_kwargs` gives, per platform."""

    creationflags: int  # Windows
    start_new_session: bool  # POSIX


def new_group_kwargs() -> GroupKwargs:
    """Keyword arguments for `subprocess.Popen` or `asyncio.create_subprocess_exec` that
    start the child as the leader of its own group (see the module docstring); `spawn`
    uses them and adds the watch."""
    if _WINDOWS:
        return {"creationflags": _CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


# The watch (POSIX shell, `spawn`). It reads the child's group id, then waits for a
# second line: "done" once the child's group is dealt with, end-of-file when
# Warmslot's process is gone. `kill -s SIG -- -PGID` is the spelling dash, bash and
# BSD sh all take.
_WATCH_SCRIPT = """\
read -r pg || exit 0
read -r word
[ "$word" = done ] && exit 0
kill -s TERM -- "-$pg" 2>/dev/null || exit 0
n=0
while [ "$n" -lt "$1" ] && kill -s 0 -- "-$pg" 2>/dev/null; do sleep 1; n=$((n + 1)); done
kill -s KILL -- "-$pg" 2>/dev/null
exit 0
"""
# Seconds the watch gives a child's group between SIGTERM and SIGKILL once Warmslot
# is gone (llama-server exits at once on SIGTERM; ninja stops its compilers first).
WATCH_GRACE_S = 5


@dataclass
class _Watch:
    proc: subprocess.Popen[bytes]
    fd: int  # the pipe's write end: only this process holds it


# Watches by the pid of the child they watch, and watches told to leave that may not
# have exited yet (collected on the next `spawn` or release). Any thread may release.
_WATCHES: dict[int, _Watch] = {}
_LEAVING: list[subprocess.Popen[bytes]] = []
_WATCH_LOCK = threading.Lock()


async def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    limit: int = 1 << 16,
) -> asyncio.subprocess.Process:
    """Start `argv` as the leader of its own group (`new_group_kwargs`), watched so that
    it does not outlive Warmslot (see the module docstring); its stdout and stderr
    come merged on ``proc.stdout`` (a reader with a line `limit`), stdin is empty.

    End every child so started with `stop_group`, or with `kill_leftovers` once it has
    exited: that kills what is left of its group and tells the watch to leave.
    """
    watch = _start_watch()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=limit,
            **new_group_kwargs(),
        )
    except BaseException:
        if watch is not None:  # end-of-file before a group id: it leaves at once
            _leave(watch, b"")
        raise
    if watch is not None:
        with contextlib.suppress(OSError):  # the watch died: the child runs unwatched
            os.write(watch.fd, b"%d\n" % proc.pid)
        with _WATCH_LOCK:
            _WATCHES[proc.pid] = watch
    return proc


def _start_watch() -> _Watch | None:
    """The watch for the next child (POSIX), or None: none on Windows, or no /bin/sh.
    A plain fork and exec of the shell: no event loop is needed to keep or collect it."""
    if _WINDOWS:
        return None
    read_end, write_end = os.pipe()  # neither is inherited by any other child
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _WATCH_SCRIPT, "warmslot-watch", str(WATCH_GRACE_S)],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Out of Warmslot's group and session: a terminal's Ctrl-C or hang-up, which
            # Warmslot answers with its own orderly stop, must not end the watch first.
            start_new_session=True,
        )
    except OSError as e:
        os.close(write_end)
        log.warning("no /bin/sh to watch a child with (%s): it may outlive a killed Warmslot", e)
        return None
    finally:
        os.close(read_end)
    return _Watch(proc, write_end)


def _release(pid: int) -> None:
    """Tell the watch of the child `pid`, if it has one, that its group is dealt with."""
    with _WATCH_LOCK:
        watch = _WATCHES.pop(pid, None)
    if watch is not None:
        _leave(watch, b"done\n")


def _leave(watch: _Watch, word: bytes) -> None:
    with contextlib.suppress(OSError):  # a watch that died reads nothing
        if word:
            os.write(watch.fd, word)
    os.close(watch.fd)
    with _WATCH_LOCK:
        _LEAVING.append(watch.proc)
        # Collect the ones that have left (a watch exits at once on "done").
        _LEAVING[:] = [p for p in _LEAVING if p.poll() is None]


def ask_to_stop(pid: int) -> bool:
    """Ask the group led by `pid` to exit: ``SIGTERM`` to the group, or ``CTRL_BREAK_EVENT``
    on Windows. False when it could not be asked (already gone, or no shared console on
    Windows): there is nothing to wait for then, kill it."""
    try:
        if _WINDOWS:
            os.kill(pid, _CTRL_BREAK_EVENT)
        else:
            os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError, OSError):
        return False
    return True


def kill_group(pid: int) -> None:
    """Kill the process `pid` and everything in its group and session (POSIX) or tree
    (Windows), now."""
    if _WINDOWS:
        _kill_tree(pid)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for member in _session_members(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def _session_members(sid: int) -> list[int]:
    """The pids of the session `sid` (POSIX), by a scan of all processes. A pid that
    names a live session or group is never handed to a new process, so none of these is
    a stranger."""
    found = []
    for pid in psutil.pids():
        try:
            if pid != sid and os.getsid(pid) == sid:
                found.append(pid)
        except OSError:  # gone meanwhile, or not ours to ask about
            continue
    return found


def kill_leftovers(pid: int) -> None:
    """Kill what is left of the group led by `pid` after the leader itself exited.

    POSIX only: the group id outlives its leader while any member lives. On Windows
    the pid alone no longer leads anywhere (and may already name another program), so
    this does nothing there. Either way the child's watch (`spawn`) is told to leave.
    """
    if not _WINDOWS:
        kill_group(pid)
    _release(pid)


def _kill_tree(pid: int) -> None:
    try:
        leader = psutil.Process(pid)
        # Listed before anything is killed: a child whose parent died is no longer
        # found through it.
        members = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return
    # The leader first, so it cannot start another helper while its children go.
    for p in members:
        with contextlib.suppress(psutil.Error):
            p.kill()


async def wait_exit(proc: asyncio.subprocess.Process) -> int:
    """Wait for `proc` itself to exit and return its exit status.

    Unlike ``proc.wait()``, this does not also wait for the process's pipes to close,
    which a helper left in its group can keep open for ever.
    """
    while proc.returncode is None:
        await asyncio.sleep(_POLL_S)
    return proc.returncode


async def stop_group(proc: asyncio.subprocess.Process, grace_s: float) -> bool:
    """Stop `proc` and its group: ask it to exit, kill the group after `grace_s` seconds,
    and kill whatever is left of the group once the leader is gone (`kill_leftovers`).
    Returns True when it had to be killed."""
    forced = False
    if proc.returncode is None:
        if ask_to_stop(proc.pid):
            try:
                await asyncio.wait_for(wait_exit(proc), grace_s)
            except TimeoutError:
                forced = True
        else:
            forced = proc.returncode is None
        if forced:
            kill_group(proc.pid)
            await wait_exit(proc)
    # Helpers it may have forked share the group and may outlive it: none may survive.
    kill_leftovers(proc.pid)
    return forced
