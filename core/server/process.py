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

Every function is safe to call on a process that is already gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from typing import TypedDict

import psutil

__all__ = [
    "ask_to_stop",
    "die_with_parent",
    "kill_group",
    "kill_leftovers",
    "new_group_kwargs",
    "stop_group",
    "wait_exit",
]

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
    start the child as the leader of its own group (see the module docstring)."""
    if _WINDOWS:
        return {"creationflags": _CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """`preexec_fn` for a child that must not outlive the thread that started it: the
    kernel sends it SIGTERM when that thread dies, even by SIGKILL (Linux only; a no-op
    elsewhere). Only the direct child is covered — its own children are reached through
    its group or session (`kill_group`)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


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
    this does nothing there.
    """
    if not _WINDOWS:
        kill_group(pid)


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
