"""Record what real coding agents send, for client profiles and their test fixtures.

A small recording reverse proxy (aiohttp, 127.0.0.1 only) sits in front of an
upstream — a llama-server this script starts, or a running Warmslot — and logs
every request (method, path, headers without credentials, JSON body) with the
response's status, its ``X-Warmslot-*`` headers and the tail of its body (where
``timings``/``usage`` are). The script then drives one real client through a
3-turn task plus the first turn of a second session, each client in a temporary
HOME so nothing of the user's is read or changed, all of them pointed at the
recorder only.

    # against a llama-server this script starts (tiny model, 128k context):
    python scripts/record_agents.py run claude --out /tmp/rec \\
        --server ~/.cache/warmslot-tests/home/cache/builds/<id>/bin/llama-server \\
        --model ~/.cache/warmslot-tests/tiny.gguf
    # against a running Warmslot (its proxy's address):
    python scripts/record_agents.py run codex --out /tmp/rec --upstream http://127.0.0.1:8089
    # what Warmslot did with each request of a run through it:
    python scripts/record_agents.py summary /tmp/rec/claude/requests.jsonl
    # trimmed fixtures for tests/fixtures/clients/<client>/:
    python scripts/record_agents.py trim /tmp/rec/claude/requests.jsonl \\
        tests/fixtures/clients/claude-cli

Clients come from ``--agents DIR`` (default ~/.cache/warmslot-agents):
``npm install --prefix DIR @anthropic-ai/claude-code @openai/codex opencode-ai`` and
aider in ``DIR/aider`` (``python3 -m venv DIR/aider && DIR/aider/bin/pip install
aider-chat``). The recorder caps each request's output tokens (``--max-tokens``,
default 24) on the way upstream — a random-weight test model would otherwise
generate until its context is full — and reports such a capped answer as a finished
one (``end_turn``/``stop``), as a real model's would be; the recorded body is the
client's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "accept-encoding",
    "keep-alive",
}
# The task every client gets: three turns of one session, then a second session.
TURNS = (
    "Read hello.py and tell me in one sentence what it does.",
    "Add a function goodbye() to hello.py that prints goodbye.",
    "Now summarise the change you made in one sentence.",
)
SECOND_SESSION = "List the files in this project."
MODEL = "tiny"


@dataclass
class Step:
    """One client invocation: which turn it is and how it is run."""

    label: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    timeout_s: float = 600.0
    before: Callable[[], None] | None = None  # run first (e.g. an edit for aider to commit)


@dataclass
class Recorder:
    """The recording proxy's state: where to forward, what step runs, the log file."""

    upstream: str
    log: Path
    max_tokens: int
    step: str = "setup"
    seq: int = 0
    session: aiohttp.ClientSession | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def cap(self, path: str, body: Any) -> Any:
        """The body sent upstream: the client's own with its output tokens capped."""
        if not isinstance(body, dict) or self.max_tokens <= 0:
            return body
        out = dict(body)
        if path.endswith("/responses"):
            keys: tuple[str, ...] = ("max_output_tokens",)
        elif path.endswith("/messages"):
            keys = ("max_tokens",)
        elif path.endswith("/chat/completions") or path.endswith("/completions"):
            keys = ("max_tokens",)
            out.pop("max_completion_tokens", None)
        else:
            return body
        for key in keys:
            value = out.get(key)
            out[key] = (
                self.max_tokens if not isinstance(value, int) else min(value, self.max_tokens)
            )
        return out

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seq += 1
        seq = self.seq
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        entry: dict[str, Any] = {
            "seq": seq,
            "step": self.step,
            "t": time.time(),
            "method": request.method,
            "path": request.path,
            "query": request.query_string,
            "headers": {
                k.lower(): v for k, v in request.headers.items() if k.lower() not in SECRET_HEADERS
            },
            "body": body,
        }
        fwd_headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        data = raw
        if isinstance(body, dict):
            data = json.dumps(self.cap(request.path, body)).encode()
            fwd_headers["Content-Type"] = "application/json"
        assert self.session is not None
        url = self.upstream + request.path_qs
        t0 = time.monotonic()
        tail = bytearray()
        try:
            async with self.session.request(
                request.method, url, data=data or None, headers=fwd_headers
            ) as up:
                resp = web.StreamResponse(status=up.status)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_HEADERS and k.lower() != "content-encoding":
                        resp.headers[k] = v
                await resp.prepare(request)
                entry["status"] = up.status
                entry["response_headers"] = {
                    k.lower(): v
                    for k, v in up.headers.items()
                    if k.lower().startswith("x-warmslot") or k.lower() == "content-type"
                }
                sse = up.headers.get("content-type", "").startswith("text/event-stream")
                chunks = up.content if sse else up.content.iter_chunked(1 << 20)
                async for chunk in chunks:  # an SSE stream line by line
                    chunk = finished(chunk)
                    tail += chunk
                    del tail[:-8192]  # keep the end: timings and usage come last
                    try:
                        await resp.write(chunk)
                    except ConnectionResetError:
                        # The client hung up once it had what it needed (Codex does,
                        # after response.completed): the rest is still read and logged.
                        entry["client_gone"] = True
                if not entry.get("client_gone"):
                    try:
                        await resp.write_eof()
                    except ConnectionResetError:
                        entry["client_gone"] = True
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            entry["status"] = 502
            entry["error"] = repr(exc)
            resp = web.Response(status=502, text=f"recorder: upstream failed: {exc!r}")
        entry["elapsed_s"] = round(time.monotonic() - t0, 3)
        entry["response_tail"] = tail.decode("utf-8", "replace")
        with self.log.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        self.counts[self.step] = self.counts.get(self.step, 0) + 1
        print(
            f"  [{seq}] {self.step}: {request.method} {request.path} -> {entry['status']} "
            f"({entry['elapsed_s']} s)",
            flush=True,
        )
        return resp


# The output cap is this harness's, not the model's: a client told "max_tokens" retries
# ("Output token limit hit. Resume directly …" from Claude Code), which a real model that
# ends its answer never causes. So the capped answer is passed on as a finished one.
_CAPPED = (
    (b'"stop_reason":"max_tokens"', b'"stop_reason":"end_turn"'),
    (b'"finish_reason":"length"', b'"finish_reason":"stop"'),
)


def finished(chunk: bytes) -> bytes:
    """`chunk` with a stop caused by the recorder's output cap reported as a normal stop."""
    for capped, normal in _CAPPED:
        chunk = chunk.replace(capped, normal)
    return chunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    binary: Path, model: Path, ctx: int, template: Path | None, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", str(ctx), "-np", "1", "--jinja", "--no-webui"]
    if template is not None:
        argv += ["--chat-template-file", str(template)]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)  # polling the health route: the server gives no other signal
    proc.kill()
    raise SystemExit("llama-server did not become healthy in 120 s")


def git_project(path: Path) -> None:
    """A small git repository for the agent to work in."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "hello.py").write_text('def hello():\n    print("hello")\n\n\nhello()\n')
    (path / "README.md").write_text("# demo\n\nA tiny project for recording agents.\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "rec", "GIT_AUTHOR_EMAIL": "rec@localhost"}
    env |= {"GIT_COMMITTER_NAME": "rec", "GIT_COMMITTER_EMAIL": "rec@localhost"}
    for argv in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "init"]):
        subprocess.run(argv, cwd=path, env=env, check=True)


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: temp HOME and XDG dirs, no proxies, no user keys."""
    env = {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "NO_PROXY": "127.0.0.1,localhost",
        "GIT_AUTHOR_NAME": "rec",
        "GIT_AUTHOR_EMAIL": "rec@localhost",
        "GIT_COMMITTER_NAME": "rec",
        "GIT_COMMITTER_EMAIL": "rec@localhost",
    }
    home.mkdir(parents=True, exist_ok=True)
    return env


def claude_steps(agents: Path, url: str, work: Path, home: Path) -> list[Step]:
    exe = str(agents / "node_modules/.bin/claude")
    env = base_env(home) | {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": "dummy",
        "ANTHROPIC_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    common = ["--max-turns", "2", "--output-format", "json"]
    steps = [Step("s1-turn1", [exe, "-p", TURNS[0], *common], env, work)]
    for i, text in enumerate(TURNS[1:], start=2):
        steps.append(Step(f"s1-turn{i}", [exe, "-p", text, "--continue", *common], env, work))
    steps.append(Step("s2-turn1", [exe, "-p", SECOND_SESSION, *common], env, work))
    return steps


def codex_steps(agents: Path, url: str, work: Path, home: Path) -> list[Step]:
    exe = str(agents / "node_modules/.bin/codex")
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "warmslot"\nsandbox_mode = "read-only"\n'
        "[model_providers.warmslot]\n"
        'name = "Warmslot"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "WARMSLOT_API_KEY"\n'
    )
    env = base_env(home) | {"CODEX_HOME": str(codex_home), "WARMSLOT_API_KEY": "dummy"}
    common = ["--skip-git-repo-check"]  # `exec resume` takes no --sandbox: config.toml has it
    steps = [Step("s1-turn1", [exe, "exec", *common, TURNS[0]], env, work)]
    for i, text in enumerate(TURNS[1:], start=2):
        steps.append(
            Step(f"s1-turn{i}", [exe, "exec", "resume", "--last", *common, text], env, work)
        )
    steps.append(Step("s2-turn1", [exe, "exec", *common, SECOND_SESSION], env, work))
    return steps


def opencode_steps(agents: Path, url: str, work: Path, home: Path) -> list[Step]:
    exe = str(agents / "node_modules/.bin/opencode")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "warmslot": {
                "npm": "@ai-sdk/openai-compatible",
                "options": {"baseURL": f"{url}/v1"},
                "models": {MODEL: {}},
            }
        },
        "model": f"warmslot/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
    }
    (work / "opencode.json").write_text(json.dumps(config, indent=2))
    env = base_env(home) | {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    }
    model = ["-m", f"warmslot/{MODEL}"]
    steps = [Step("s1-turn1", [exe, "run", *model, TURNS[0]], env, work)]
    for i, text in enumerate(TURNS[1:], start=2):
        steps.append(Step(f"s1-turn{i}", [exe, "run", "--continue", *model, text], env, work))
    steps.append(Step("s2-turn1", [exe, "run", *model, SECOND_SESSION], env, work))
    return steps


def aider_steps(agents: Path, url: str, work: Path, home: Path) -> list[Step]:
    exe = str(agents / "aider/bin/aider")
    env = base_env(home) | {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    common = [
        "--model",
        f"openai/{MODEL}",
        "--openai-api-base",
        f"{url}/v1",
        "--openai-api-key",
        "dummy",
        "--no-check-update",
        "--no-show-release-notes",
        "--no-analytics",
        "--yes-always",
        "--no-show-model-warnings",
        "--no-pretty",
        "hello.py",
    ]
    steps = [Step("s1-turn1", [exe, *common, "--message", TURNS[0]], env, work)]
    # A small history budget makes aider summarise the restored history (its summary
    # side call) as a long session would.
    history = ["--restore-chat-history", "--max-chat-history-tokens", "256"]
    for i, text in enumerate(TURNS[1:], start=2):
        argv = [exe, *common, *history, "--message", text]
        steps.append(Step(f"s1-turn{i}", argv, env, work))

    def edit() -> None:  # a change of the user's for aider to commit (its commit side call)
        with (work / "hello.py").open("a") as f:
            f.write('\n\ndef goodbye():\n    print("goodbye")\n')

    commit = [exe, *common, *history, "--message", "/commit"]
    steps.append(Step("s1-commit", commit, env, work, before=edit))
    steps.append(Step("s2-turn1", [exe, *common, "--message", SECOND_SESSION], env, work))
    return steps


CLIENTS = {
    "claude": claude_steps,
    "codex": codex_steps,
    "opencode": opencode_steps,
    "aider": aider_steps,
}


async def run_client(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser().resolve() / args.client
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    server = None
    upstream = args.upstream
    if upstream is None:
        template = Path(args.chat_template).resolve() if args.chat_template else None
        server, upstream = start_server(
            Path(args.server).expanduser(),
            Path(args.model).expanduser(),
            args.ctx,
            template,
            out / "llama-server.log",
        )
    rec = Recorder(upstream.rstrip("/"), out / "requests.jsonl", args.max_tokens)
    rec.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    print(f"recorder {url} -> {upstream}", flush=True)
    work = out / "work"
    git_project(work)
    steps = CLIENTS[args.client](Path(args.agents).expanduser(), url, work, out / "home")
    extra = dict(kv.split("=", 1) for kv in args.env)
    for step in steps:
        step.env.update(extra)
    meta: dict[str, Any] = {"client": args.client, "upstream": upstream, "steps": []}
    meta["env"] = extra
    rc_all = 0
    try:
        for step in steps:
            rec.step = step.label
            print(f"{step.label}: {' '.join(step.argv[1:])}", flush=True)
            if step.before is not None:
                step.before()
            t0 = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *step.argv,
                cwd=step.cwd,
                env=step.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            try:
                output, _ = await asyncio.wait_for(proc.communicate(), step.timeout_s)
                rc = proc.returncode
            except TimeoutError:
                proc.kill()
                output, _ = await proc.communicate()
                rc = -9
            text = output.decode("utf-8", "replace")
            (out / f"{step.label}.out").write_text(text)
            elapsed = round(time.monotonic() - t0, 1)
            print(f"  rc={rc} in {elapsed} s, {rec.counts.get(step.label, 0)} requests")
            meta["steps"].append(
                {
                    "label": step.label,
                    "argv": [Path(step.argv[0]).name, *step.argv[1:]],
                    "rc": rc,
                    "elapsed_s": elapsed,
                    "requests": rec.counts.get(step.label, 0),
                }
            )
            rc_all = rc_all or (rc or 0)
    finally:
        rec.step = "teardown"
        await rec.session.close()
        await runner.cleanup()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    meta["version"] = client_version(args.client, Path(args.agents).expanduser())
    (out / "run.json").write_text(json.dumps(meta, indent=2))
    return 0 if rc_all == 0 else 1


def client_version(client: str, agents: Path) -> str:
    exe = {
        "claude": agents / "node_modules/.bin/claude",
        "codex": agents / "node_modules/.bin/codex",
        "opencode": agents / "node_modules/.bin/opencode",
        "aider": agents / "aider/bin/aider",
    }[client]
    env = base_env(agents / "version-home")
    done = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, env=env, timeout=60
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "?"


# --- trimming ---------------------------------------------------------------------

TRIM_AT = 4000  # characters: a longer tool result or file dump is cut (and the cut recorded)


def _trim_text(text: str, where: str, notes: list[str]) -> str:
    if len(text) <= TRIM_AT:
        return text
    notes.append(f"{where}: {len(text)} chars cut to {TRIM_AT}")
    return text[:TRIM_AT] + f"\n[... trimmed {len(text) - TRIM_AT} chars ...]"


def _trim_message_content(content: Any, where: str, notes: list[str]) -> Any:
    if isinstance(content, str):
        return _trim_text(content, where, notes)
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, dict):
                part = dict(part)
                for key in ("text", "content", "output"):
                    if isinstance(part.get(key), str):
                        part[key] = _trim_text(part[key], f"{where}[{i}].{key}", notes)
            out.append(part)
        return out
    return content


def trim_body(body: Any, notes: list[str]) -> Any:
    """The body with long tool results and file dumps cut; system and tools kept whole."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        trimmed = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                trimmed.append(item)
                continue
            item = dict(item)
            if item.get("role") in ("system", "developer"):
                trimmed.append(item)  # the system prompt is what the profiles are about
                continue
            for field_name in ("content", "output"):
                if field_name in item:
                    item[field_name] = _trim_message_content(
                        item[field_name], f"{key}[{i}].{field_name}", notes
                    )
            trimmed.append(item)
        body[key] = trimmed
    return body


def trim(args: argparse.Namespace) -> int:
    src = Path(args.requests)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    entries = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    kept = []
    for e in entries:
        if e["method"] != "POST" or not isinstance(e.get("body"), dict):
            kept.append({k: e[k] for k in ("seq", "step", "method", "path", "status")})
            continue
        local: list[str] = []
        body = trim_body(e["body"], local)
        notes += [f"request {e['seq']} ({e['step']} {e['path']}): {n}" for n in local]
        kept.append(
            {
                "seq": e["seq"],
                "step": e["step"],
                "method": e["method"],
                "path": e["path"],
                "query": e.get("query", ""),
                "headers": e["headers"],
                "body": body,
                "status": e.get("status"),
                "response_headers": e.get("response_headers", {}),
            }
        )
    out = dest / "requests.json"
    out.write_text(json.dumps(kept, indent=1, ensure_ascii=False) + "\n")
    (dest / "TRIMMED.txt").write_text("\n".join(notes) + "\n" if notes else "nothing trimmed\n")
    print(f"{len(kept)} requests -> {out} ({out.stat().st_size} bytes), {len(notes)} cuts")
    return 0


def summary(args: argparse.Namespace) -> int:
    """One line per POST of a run through Warmslot, from its X-Warmslot-* response headers
    (the tests/fixtures/clients/*/through-warmslot*.txt files)."""
    for line in Path(args.requests).read_text().splitlines():
        e = json.loads(line) if line.strip() else {}
        if e.get("method") != "POST":
            continue
        h = {
            k.lower()[len("x-warmslot-") :]: v
            for k, v in e.get("response_headers", {}).items()
            if k.lower().startswith("x-warmslot-")
        }
        cached, read = int(h.get("cached-tokens") or 0), int(h.get("prefilled-tokens") or 0)
        total = cached + read
        print(
            e["seq"], e["step"], e.get("status"), h.get("kind"), "slot", h.get("slot"),
            h.get("cache"), f"cached {cached} / {total} = {cached / max(1, total):.1%}",
            "prefix", h.get("prefix"), "sess", (h.get("session") or "")[:14],
            "restored", h.get("restored"), "edited", h.get("edited", "-"),
        )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="drive one client through the task, recording")
    run.add_argument("client", choices=sorted(CLIENTS))
    run.add_argument("--out", required=True)
    run.add_argument("--agents", default="~/.cache/warmslot-agents")
    run.add_argument("--upstream", help="forward to this URL instead of starting llama-server")
    run.add_argument("--server", help="llama-server binary to start")
    run.add_argument("--model", help="GGUF model for the started llama-server")
    run.add_argument("--chat-template", help="--chat-template-file for llama-server")
    run.add_argument("--ctx", type=int, default=131072)
    run.add_argument("--max-tokens", type=int, default=24)
    run.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="set for the client"
    )
    tr = sub.add_parser("trim", help="write trimmed fixtures from a requests.jsonl")
    tr.add_argument("requests")
    tr.add_argument("dest")
    sm = sub.add_parser("summary", help="one line per request of a run, from X-Warmslot-*")
    sm.add_argument("requests")
    args = parser.parse_args(argv)
    if args.cmd == "trim":
        return trim(args)
    if args.cmd == "summary":
        return summary(args)
    if args.upstream is None and not (args.server and args.model):
        parser.error("run needs --upstream, or --server and --model")
    return asyncio.run(run_client(args))


if __name__ == "__main__":
    sys.exit(main())
