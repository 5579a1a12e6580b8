"""The pressure sampler reads the folders it is given at each sample (core.pressure):
the engine gives each running server's ``--slot-save-path``, which moves with the server
identity and may lie on another disk than ``state/slots``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from core.machine.pressure import Sampler


class FakePs:
    def virtual_memory(self) -> Any:
        return SimpleNamespace(total=100, available=50)

    def swap_memory(self) -> Any:
        return SimpleNamespace(total=0, used=0)


def test_the_watched_folders_are_read_at_each_sample(tmp_path: Path) -> None:
    first, second = tmp_path / "slots" / "aaaa", tmp_path / "slots" / "bbbb"
    first.mkdir(parents=True)
    second.mkdir()
    watched = [first]
    asked: list[Path] = []

    def usage(path: Path) -> Any:
        asked.append(path)
        return SimpleNamespace(total=1000, free=100 if path == second else 900)

    sampler = Sampler(
        lambda: list(watched), lambda: None, ps=FakePs(), gpus=False, disk_usage=usage
    )
    r = sampler.read()
    assert r.disk_path == str(first) and r.disk_free == 900
    watched[:] = [second]  # a new server identity: a new folder
    r = sampler.read()
    assert r.disk_path == str(second) and r.disk_free == 100
    assert asked == [first, second]
