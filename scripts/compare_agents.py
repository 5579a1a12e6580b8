"""Each coding agent against bare llama-server and against Warmslot, in one run.

Both arms run the same client, model, chat template, slots and context: bare
llama-server with ``-np SLOTS -c SLOTS×CTX`` and `warmslot serve` with
``server.slots = SLOTS``, ``server.ctx_per_slot = CTX`` on the same binary. Each arm
drives the client through the task of `record_agents` (three turns of a session, the
first turn of a second one), then **restarts its server** (bare: llama-server is
stopped and started again; Warmslot: `warmslot serve` gets SIGINT, as at a logout, and
is started again) and runs two more turns: the second session resumed, and a new
third session. The recording proxy of `record_agents` sits in front of each arm.

What a request reused is llama-server's own count: the ``timings`` of the answer's last
event (``cache_n`` of ``cache_n + prompt_n``), the same in both arms
(docs/llama-server-facts.md#timings). The table gives, per step, the reuse of the
step's largest request (the agent turn) and the prompt tokens the server computed for
all of the step's requests.

    python scripts/compare_agents.py claude --out /tmp/cmp \\
        --server ~/.cache/warmslot-tests/home/cache/builds/<id>/bin/llama-server \\
        --model /tmp/tiny-256k.gguf --chat-template resources/templates/gemma3-tools.jinja

Clients come from ``--agents DIR`` as for `record_agents`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from record_agents import (  # scripts/ is on the path when this runs as a script
    CLIENTS,
    SECOND_SESSION,
    TURNS,
    Recorder,
    Step,
    client_version,
    free_port,
    git_project,
)

from core.paths import Paths

RESUMED = "Which file did you change, and what does README.md say?"
THIRD_SESSION = "What is in README.md?"
REPO = Path(__file__).resolve().parents[1]  # this checkout's Warmslot, whatever is installed


def steps_for(client: str, agents: Path, url: str, work: Path, home: Path) -> list[Step]:
    """The client's task, then (after the restart) session 2 resumed and a new session:
    the same command forms as its second turn and its second session."""
    steps = CLIENTS[client](agents, url, work, home)
    by = {s.label: s for s in steps}
    cont, new = by["s1-turn2"], by["s2-turn1"]
    resume = [RESUMED if a == TURNS[1] else a for a in cont.argv]
    third = [THIRD_SESSION if a == SECOND_SESSION else a for a in new.argv]
    return [
        *steps,
        Step("restart-s2-resumed", resume, cont.env, cont.cwd),
        Step("restart-s3-turn1", third, new.env, new.cwd),
    ]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _wait(what: str, ready: Any, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.5)  # polling its HTTP routes: the server gives no other signal
    raise SystemExit(f"{what} was not ready in {timeout:.0f} s")


class Bare:
    """llama-server with the same slots and context as Warmslot's, restarted in place."""

    name = "bare llama-server"

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.port = free_port()
        self.argv = [str(Path(args.server).expanduser()), "-m", str(args.model)]
        self.argv += ["--host", "127.0.0.1", "--port", str(self.port), "--jinja", "--no-webui"]
        self.argv += ["-np", str(args.slots), "-c", str(args.slots * args.ctx)]
        if args.chat_template:
            self.argv += ["--chat-template-file", str(Path(args.chat_template).resolve())]
        self.log = out / "llama-server.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        self.proc_ready()

    def proc_ready(self) -> None:
        assert self.proc is not None

        def healthy() -> bool:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200

        _wait("llama-server", healthy, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
            self.proc = None


class Warmslot:
    """`warmslot serve` in a home of its own, on the same binary, model and template."""

    name = "Warmslot"

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.port = free_port()
        self.home = out / "warmslot-home"
        config_file = Paths.under(self.home).config_file
        config_file.parent.mkdir(parents=True, exist_ok=True)
        template = str(Path(args.chat_template).resolve()) if args.chat_template else ""
        config_file.write_text(
            "[server]\n"
            f"binary = {json.dumps(str(Path(args.server).expanduser()))}\n"
            f"model = {json.dumps(str(args.model))}\n"
            f"slots = {args.slots}\nctx_per_slot = {args.ctx}\n"
            f"chat_template_file = {json.dumps(template)}\n"
        )
        self.log = out / "warmslot-serve.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "WARMSLOT_HOME": str(self.home), "PYTHONPATH": str(REPO)}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "core.cli.main", "serve", "--port", str(self.port)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def ready() -> bool:
            status = _get_json(self.url + "/warmslot/status")
            return bool(status.get("server", {}).get("state") == "ready")

        _wait("warmslot serve", ready, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)  # as a logout stops it: its saves run
            self.proc.wait(timeout=300)
            self.proc = None


@contextmanager
def recording(upstream: str, log: Path, max_tokens: int) -> Iterator[tuple[Recorder, str]]:
    """The recording proxy of `record_agents` on its own loop thread."""
    import threading

    rec = Recorder(upstream, log, max_tokens)
    loop = asyncio.new_event_loop()
    port = free_port()
    started = threading.Event()
    runner_box: list[web.AppRunner] = []

    async def serve() -> None:
        rec.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", rec.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runner_box.append(runner)
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(30)
    started.wait(30)
    try:
        yield rec, f"http://127.0.0.1:{port}"
    finally:

        async def close() -> None:
            assert rec.session is not None
            await rec.session.close()
            await runner_box[0].cleanup()

        asyncio.run_coroutine_threadsafe(close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


_TIMINGS = re.compile(r'"timings"\s*:\s*(\{[^{}]*\})')


def reuse(entry: dict[str, Any]) -> tuple[int, int] | None:
    """(cached, computed) prompt tokens of one recorded answer: its last ``timings``."""
    found = _TIMINGS.findall(entry.get("response_tail", ""))
    if not found:
        return None
    t = json.loads(found[-1])
    return int(t.get("cache_n", 0)), int(t.get("prompt_n", 0))


def run_arm(arm: Bare | Warmslot, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "requests.jsonl"
    arm.start()
    rows: list[dict[str, Any]] = []
    try:
        with recording(arm.url, log, args.max_tokens) as (rec, url):
            work = out / "work"
            git_project(work)
            steps = steps_for(args.client, Path(args.agents).expanduser(), url, work, out / "home")
            for step in steps:
                if step.label == "restart-s2-resumed":
                    print(f"  restarting {arm.name}", flush=True)
                    arm.stop()
                    arm.start()
                rec.step = step.label
                print(f"{arm.name} {step.label}: {' '.join(step.argv[1:])[:120]}", flush=True)
                if step.before is not None:
                    step.before()
                t0 = time.monotonic()
                done = subprocess.run(
                    step.argv,
                    cwd=step.cwd,
                    env=step.env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=args.step_timeout,
                )
                (out / f"{step.label}.out").write_bytes(done.stdout + done.stderr)
                rows.append({"step": step.label, "rc": done.returncode, "s": time.monotonic() - t0})
    finally:
        arm.stop()
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for row in rows:
        counted = [r for e in entries if e["step"] == row["step"] if (r := reuse(e))]
        row["computed"] = sum(c for _, c in counted)
        if counted:
            cached, computed = max(counted, key=lambda r: r[0] + r[1])
            row["main"] = (cached, cached + computed)
    return {"arm": arm.name, "rows": rows}


def table(client: str, version: str, arms: list[dict[str, Any]]) -> str:
    """A markdown table: each step, each arm's reuse of its agent turn and prefill."""
    head = "| step | " + " | ".join(f"{a['arm']}: agent turn reused" for a in arms)
    head += " | " + " | ".join(f"{a['arm']}: tokens computed" for a in arms) + " |"
    lines = [f"{client} {version}", "", head, "|---" * (1 + 2 * len(arms)) + "|"]
    for i, row in enumerate(arms[0]["rows"]):
        cells = []
        for a in arms:
            r = a["rows"][i]
            if "main" in r:
                cached, total = r["main"]
                cells.append(f"{cached:,} of {total:,} ({100 * cached / total:.1f} %)")
            else:
                cells.append(f"— (rc {r['rc']})")
        cells += [f"{a['rows'][i]['computed']:,}" for a in arms]
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("client", choices=sorted(CLIENTS))
    p.add_argument("--out", required=True)
    p.add_argument("--agents", default="~/.cache/warmslot-agents")
    p.add_argument("--server", required=True, help="llama-server binary (both arms)")
    p.add_argument("--model", required=True, type=lambda s: Path(s).expanduser().resolve())
    p.add_argument("--chat-template", help="chat template file (both arms)")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--ctx", type=int, default=81920, help="context per slot")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--step-timeout", type=float, default=1800, help="seconds per client run")
    args = p.parse_args(argv)
    out = Path(args.out).expanduser().resolve() / args.client
    shutil.rmtree(out, ignore_errors=True)  # a run starts from nothing, as record_agents'
    arms = [
        run_arm(Bare(args, out / "bare"), args, out / "bare"),
        run_arm(Warmslot(args, out / "warmslot"), args, out / "warmslot"),
    ]
    version = client_version(args.client, Path(args.agents).expanduser())
    (out / "compare.json").write_text(json.dumps({"version": version, "arms": arms}, indent=2))
    print(table(args.client, version, arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
