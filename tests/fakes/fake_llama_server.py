#!/usr/bin/env python3
"""A fake llama-server for faults a real one cannot show on demand.

Used only by tests/core/test_supervisor_faults.py (through a small executable
wrapper, see tests.helpers.make_fake_binary). It accepts llama-server's
arguments (it reads ``--host``, ``--port`` and ``--no-repack`` and ignores the
rest), prints lines in llama-server's log format, and answers ``--version``
like llama-server.

Fake options (before the llama-server arguments):

--fake-mode serve          listen and answer /health, /v1/models, /metrics,
                           /v1/chat/completions and /completion (default)
--fake-mode crash-warmup   crash with SIGSEGV during warm-up (AMX repacking) unless
                           --no-repack is given; with it, serve
--fake-mode slow-start     print the loading lines, then never bind
--fake-mode die            print the loading lines, then die by --fake-signal NAME
                           (ILL, SEGV, BUS …; as a binary built for another CPU does)
--fake-mode exit           print the loading lines, then exit with --fake-exit N
--fake-crash-after S       (serve) crash with SIGSEGV S seconds after listening
--fake-fork-child FILE     fork a helper that ignores SIGTERM, keeps stdout open
                           and writes its pid to FILE (proves process-group kills)
--fake-launch-log FILE     append one line per launch ("pid no_repack=0|1")
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "version: 0.0.0-fake (build 1, commit fa4e000)"
T0 = time.monotonic()


def log(level: str, area: str, text: str) -> None:
    ms = int((time.monotonic() - T0) * 1000)
    stamp = f"0.{ms // 60000:02d}.{(ms // 1000) % 60:03d}.{ms % 1000:03d}"
    print(f"{stamp} {level} {area:<4} {text}", flush=True)


def crash(sig: signal.Signals = signal.SIGSEGV) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
    sys.stdout.flush()
    if threading.current_thread() is threading.main_thread():  # only it may set handlers
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    block_forever()  # pragma: no cover - the signal ends us first


def block_forever() -> None:
    while True:
        signal.pause()


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    fake: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg.startswith("--fake-"):
            fake[arg[7:]] = next(it)
        else:
            rest.append(arg)
    return fake, rest


def value(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def fork_helper(pidfile: str) -> None:
    pid = os.fork()
    if pid == 0:  # the helper: survives SIGTERM, only a SIGKILL to the group ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        block_forever()
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(pidfile + ".tmp", pidfile)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _json(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/health"):
            self._json(200, {"status": "ok"})
        elif self.path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif self.path == "/metrics":
            text = b"llamacpp:prompt_tokens_total 0\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
        else:
            self._json(404, {"error": {"message": "not found", "code": 404}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        timings = {"cache_n": 0, "prompt_n": 3, "prompt_ms": 1.0, "predicted_n": 1}
        if self.path in ("/v1/chat/completions", "/chat/completions"):
            self._json(
                200,
                {
                    "object": "chat.completion",
                    "model": "fake",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "length",
                            "message": {"role": "assistant", "content": "fake"},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                    "timings": timings,
                    "echo_cache_prompt": body.get("cache_prompt"),
                },
            )
        elif self.path in ("/completion", "/completions", "/v1/completions"):
            self._json(200, {"content": "fake", "id_slot": 0, "stop": True, "timings": timings})
        else:
            self._json(404, {"error": {"message": "not found", "code": 404}})


def serve(host: str, port: int, crash_after: float | None) -> None:
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    log("I", "srv", "llama_server: model loaded")
    log("I", "srv", f"llama_server: listening on http://{host}:{port}")
    if crash_after is not None:

        def later() -> None:
            log("E", "srv", "fake: crashing now")
            crash()

        timer = threading.Timer(crash_after, later)
        timer.daemon = True
        timer.start()
    server.serve_forever()


def main() -> None:
    fake, args = parse(sys.argv[1:])
    if "--version" in args:
        print(VERSION)
        print("built with fake-cc for x86_64")
        return
    if "--list-devices" in args:  # as a CPU build answers (core.machine.devices)
        print("Available devices:\n  (none)")
        return
    mode = fake.get("mode", "serve")
    no_repack = "--no-repack" in args
    if "launch-log" in fake:
        with open(fake["launch-log"], "a") as f:
            f.write(f"{os.getpid()} no_repack={int(no_repack)}\n")
    host = value(args, "--host", "127.0.0.1")
    port = int(value(args, "--port", "8080"))
    log("I", "srv", f"load_model: loading model '{value(args, '-m', '?')}'")
    if "fork-child" in fake:
        fork_helper(fake["fork-child"])
    if mode == "crash-warmup" and not no_repack:
        log("I", "cpu", "repack: repack tensor blk.0.attn_q.weight with q4_0_8x8 (AMX)")
        crash()
    if mode == "slow-start":
        block_forever()
    if mode == "die":
        log("I", "cmn", "init: llama threadpool init, n_threads = 1")
        crash(signal.Signals[f"SIG{fake.get('signal', 'ILL')}"])
    if mode == "exit":
        log("E", "srv", "fake: giving up")
        sys.exit(int(fake.get("exit", "1")))
    crash_after = float(fake["crash-after"]) if "crash-after" in fake else None
    serve(host, port, crash_after)


if __name__ == "__main__":
    main()
