"""Real clients' sessions through Warmslot, with their recorded requests.

Replayed through a real Core and llama-server (the tiny model, whose character-level
tokenizer makes these prompts 2–3× their real-model size; docs/clients.md):

- Codex CLI (tests/fixtures/clients/codex: OpenAI Responses, 17k tokens): the first turn
  of a second session must find the stable prefix that the first session's slot holds.
  It went to an empty slot and re-read everything (0 of 17,447 tokens reused) while the
  cache manager compared the slot's last chat view with the client's raw Responses
  body, which never match.
- Claude Code (tests/fixtures/clients/claude-code: Anthropic Messages) without
  CLAUDE_CODE_ATTRIBUTION_HEADER=0: its system text opens with an attribution line
  whose stamp differs per session, so the second session's prompt left every slot at
  the system text's first token (0 of 53,068 tokens reused) until the proxy took the
  line out of the body (core.proxy.billing.strip_billing_header).
- aider (tests/fixtures/clients/aider: chat completions): turns 2 and 3 reuse all the
  tokens their prompt shares with the previous turn's — about 60 %, because aider
  puts the chat history before the files it re-sends (why --cache-reuse cannot help:
  docs/clients.md#missed-targets).
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from httpx import Headers

from core.cache.manager import policy_factory
from core.events import RequestCompleted
from core.server import discover
from core.server.tinymodel import make_tiny_model
from tests.conftest import MakeCore
from tests.conftest import test_cache as cache_dir
from tests.helpers import EventLog, post_chat, wait_until

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"
SESSION_HEADERS = ("user-agent", "session-id", "x-claude-code-session-id", "anthropic-version")


def _copies(server_binary: Path) -> bool:
    """Whether the server copies a prefix between slots (patch 0004's prefix save)."""
    return "prefix-save-v1" in discover.patch_levels(server_binary)


def _recorded(client: str) -> list[dict[str, Any]]:
    entries = json.loads((FIXTURES / client / "requests.json").read_text())
    return [e for e in entries if e["method"] == "POST" and e.get("body")]


def _post(port: int, entry: dict[str, Any], **changes: Any) -> Headers:
    """A recorded request again, not streamed, with its session headers: the answer's headers."""
    body = {**entry["body"], "stream": False, **changes}
    headers = {k: v for k, v in entry["headers"].items() if k in SESSION_HEADERS}
    return post_chat(port, body, path=entry["path"], headers=headers).headers


def _core(make_core: MakeCore, **changes: Any) -> Any:
    model = make_tiny_model(cache_dir() / "tiny-32k.gguf", n_ctx=32768)
    core = make_core(
        policy_factory=policy_factory,
        server__model=str(model),
        server__slots=3,
        server__ctx_per_slot=24576,
        **changes,
    )
    log = EventLog()
    core.subscribe(log.append, (RequestCompleted,))
    core.start(wait_ready=True, timeout=120)
    assert core.proxy is not None
    return core, log


def _done(log: EventLog, n: int, endpoint: str | None = None) -> list[RequestCompleted]:
    def finished() -> list[RequestCompleted]:
        return [r for r in log.of(RequestCompleted) if endpoint in (None, r.endpoint)]

    wait_until(lambda: len(finished()) >= n, 60, message=f"{n} requests recorded")
    done = finished()
    print(
        "\n" + "; ".join(f"slot {r.slot} cache_n {r.cache_n} prompt_n {r.prompt_n}" for r in done)
    )
    return done


def test_a_second_codex_session_starts_from_the_prefix_the_first_ones_slot_holds(
    make_core: MakeCore, server_binary: Path
) -> None:
    entries = _recorded("codex")
    first = next(e for e in entries if e["step"] == "s1-turn1")
    second = next(e for e in entries if e["step"] == "s2-turn1")
    core, log = _core(make_core)
    h1 = _post(core.proxy.port, first, max_output_tokens=4)
    prefix_tokens = int(h1["X-Warmslot-Prefix"].split(":")[1])
    assert prefix_tokens >= 10_000  # Codex's developer text and tools
    h2 = _post(core.proxy.port, second, max_output_tokens=4)
    done = _done(log, 2)
    print(f"stable prefix {prefix_tokens}")
    assert h1["X-Warmslot-Session"] != h2["X-Warmslot-Session"]
    if _copies(server_binary):
        # Copied from the first session's slot into its own (a prefix save restored there,
        # docs/cache.md#the-shared-prefix-wherever-it-is); the first session keeps its slot.
        assert h2["X-Warmslot-Slot"] != h1["X-Warmslot-Slot"]
        assert int(h2["X-Warmslot-Restored"]) >= 0.9 * prefix_tokens
    else:  # it goes where its prefix is (the first session is saved and moves)
        assert h2["X-Warmslot-Slot"] == h1["X-Warmslot-Slot"]
    assert done[1].cache_n is not None and done[1].cache_n >= 0.9 * prefix_tokens


def _claude_shaped(entry: dict[str, Any]) -> dict[str, Any]:
    """A recorded Claude Code request with only its smaller tool schemas (~11k tokens
    here instead of 53k): its system text — attribution line, stable head, per-project
    tail — and its messages are as recorded."""
    entry = copy.deepcopy(entry)
    body = entry["body"]
    body["tools"] = [t for t in body["tools"] if len(json.dumps(t)) < 1000]
    assert len(body["tools"]) >= 5
    return entry


def test_a_second_claude_code_session_reuses_the_system_text_despite_its_new_stamp(
    make_core: MakeCore, server_binary: Path
) -> None:
    entries = _recorded("claude-code")
    first = _claude_shaped(next(e for e in entries if e["step"] == "s1-turn1"))
    second = _claude_shaped(next(e for e in entries if e["step"] == "s2-turn1"))
    stamps = [e["body"]["system"][0]["text"] for e in (first, second)]
    assert stamps[0] != stamps[1] and all("billing-header" in s for s in stamps)
    core, log = _core(make_core)
    h1 = _post(core.proxy.port, first, max_tokens=4)
    prefix_tokens = int(h1["X-Warmslot-Prefix"].split(":")[1])
    assert prefix_tokens >= 1_000  # the system text's stable head (Claude Code's profile)
    h2 = _post(core.proxy.port, second, max_tokens=4)
    done = _done(log, 2)
    print(f"stable prefix {prefix_tokens}")
    assert h1["X-Warmslot-Session"] != h2["X-Warmslot-Session"]
    # The second session starts from the first one's stable prefix — copied into its own
    # slot where the server saves part of a slot, else in the first one's — and reuses it.
    assert (h2["X-Warmslot-Slot"] != h1["X-Warmslot-Slot"]) == _copies(server_binary)
    assert done[1].cache_n is not None and done[1].cache_n >= 0.9 * prefix_tokens
    assert h1["X-Warmslot-Edited"] == h2["X-Warmslot-Edited"] == "billing-header"
    # The explanation says the prompt it describes is the edited one.
    url = f"http://127.0.0.1:{core.proxy.port}/warmslot/explain?id={h2['X-Warmslot-Request-Id']}"
    rec: dict[str, Any] = {}

    def explained() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                rec.update(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            assert e.code == 404  # not explained yet
        return bool(rec)

    wait_until(explained, 120, message="the second session's request explained")
    assert rec["edits"] == ["billing-header"]


def test_aider_turns_reuse_all_they_share_with_the_previous_turn(make_core: MakeCore) -> None:
    entries = [e for e in _recorded("aider") if e["step"].startswith("s1-turn")]
    core, log = _core(make_core)
    port = core.proxy.port
    ua = {"user-agent": entries[0]["headers"]["user-agent"]}
    # Each turn's prompt in tokens, as the server renders and reads it.
    prompts = []
    for e in entries:
        body = {k: v for k, v in e["body"].items() if k == "messages"}
        rendered = post_chat(port, body, path="/apply-template", headers=ua).json()
        tokenize = {"content": rendered["prompt"], "add_special": True}
        toks = post_chat(port, tokenize, path="/tokenize", headers=ua).json()
        prompts.append(toks["tokens"])
    for e in entries:
        _post(port, e, max_tokens=24, temperature=0)
    done = _done(log, 3, "chat")  # not the /apply-template and /tokenize calls
    for k in (1, 2):
        prev, cur = prompts[k - 1], prompts[k]
        shared = next(
            (i for i, (a, b) in enumerate(zip(prev, cur, strict=False)) if a != b),
            min(len(prev), len(cur)),
        )
        reused = done[k].cache_n
        print(f"turn {k + 1}: {len(cur)} tokens, {shared} shared with turn {k}, reused {reused}")
        # Everything the two prompts share, and no more: they part where aider's new
        # history entry goes in before the files, well short of 95 %.
        assert reused is not None and shared - 2 <= reused <= shared
        assert 0.4 < shared / len(cur) < 0.8
