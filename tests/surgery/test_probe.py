"""The bound on the meta-device probe load_pretrained builds (headwise.surgery.probe): per thread, and without
changing torch's process-wide hooks under other threads. Reference: plain module construction in other threads."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from headwise.surgery.probe import TooLarge, bounded


class _Config:
    def to_dict(self) -> dict:
        return {"num_hidden_layers": 10**6}


def _hooks() -> int:
    return len(torch.nn.modules.module._global_module_registration_hooks)


def test_a_probe_over_its_bound_is_refused_and_other_threads_build_freely():
    with bounded(nn.Module, _Config(), Path("/folder"), 0):
        pass  # the first load registers torch's hook once
    before = _hooks()
    inside, done, errors, refused, during = threading.Event(), threading.Event(), [], [], []

    def probe() -> None:
        with bounded(nn.Module, _Config(), Path("/folder"), 0):  # a floor of modules, no weights
            during.append(_hooks())
            inside.set()
            done.wait(30)
            try:
                nn.ModuleList(nn.Linear(1, 1, device="meta") for _ in range(3000))
            except TooLarge as exc:
                refused.append(str(exc))

    def other() -> None:
        inside.wait(30)
        try:  # another thread's models are not the probe's to count, while it is bounded
            nn.ModuleList(nn.Linear(1, 1, device="meta") for _ in range(3000))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        done.set()

    threads = [threading.Thread(target=probe), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert len(refused) == 1 and "(num_hidden_layers=1000000) builds more than 2048 modules" in refused[0], refused
    # torch walks its hook dict at every registration in every thread: a load must not add or remove one there
    assert during == [before] and _hooks() == before
    nn.ModuleList(nn.Linear(1, 1, device="meta") for _ in range(3000))  # no bound outside a load
