"""Save/resume: round trip of model, optimizer, RNG and counters; atomic commit; safe loading."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from saved_files import rewrite_listed  # next to this file
from torch import nn

from spartron.runtime.state import (
    COMPLETE,
    StateLoadError,
    complete_steps,
    latest_complete_step,
    load_state,
    save_state,
    step_dir,
)

CPU = torch.device("cpu")




def _trained(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # gradients without autograd: a parent that ran backward cannot fork
        p.grad = torch.randn_like(p)  # ranks on CUDA builds of torch (autograd's device threads)
    opt.step()
    return model, opt


@pytest.fixture(autouse=True)
def _quiet_dcp_single_process_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_round_trip_restores_model_optimizer_rng_and_counters(tmp_path):
    model, opt = _trained(0)
    random.seed(5)
    np.random.seed(6)
    path = save_state(tmp_path, 3, model, opt, {"tokens": 96}, {"data": {"position": 7}}, CPU)
    assert path == step_dir(tmp_path, 3) and (path / COMPLETE).is_file()
    assert not (tmp_path / ".tmp-step-00000003").exists()
    expected = (random.random(), float(np.random.rand()), torch.rand(2))

    model2, opt2 = _trained(1)
    meta, rank_state = load_state(path, model2, opt2, CPU)
    assert meta["step"] == 3 and meta["counters"] == {"tokens": 96}
    assert rank_state == {"data": {"position": 7}}
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for s1, s2 in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(s1[k], s2[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_failed_commit_leaves_previous_state_the_latest(tmp_path):
    model, opt = _trained(0)
    save_state(tmp_path, 2, model, opt, {}, {}, CPU)

    def crash(tmp_dir):
        raise OSError(f"injected crash while saving {tmp_dir.name}")

    with pytest.raises(OSError, match="injected crash while saving .tmp-step-00000004"):
        save_state(tmp_path, 4, model, opt, {}, {}, CPU, before_commit=crash)
    assert complete_steps(tmp_path) == [2] and latest_complete_step(tmp_path) == 2
    (tmp_path / "step-00000006").mkdir()  # a directory without the marker never counts
    assert latest_complete_step(tmp_path) == 2
    with pytest.raises(StateLoadError, match="not a complete saved state"):
        load_state(tmp_path / "step-00000006", model, opt, CPU)
    load_state(step_dir(tmp_path, 2), model, opt, CPU)
    save_state(tmp_path, 4, model, opt, {}, {}, CPU)  # the debris of the crashed save is replaced
    assert complete_steps(tmp_path) == [2, 4] and not (tmp_path / ".tmp-step-00000004").exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_refuses_to_unpickle_foreign_objects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = _trained(0)
    path = save_state(tmp_path / "run", 1, model, opt, {}, {}, CPU)
    rewrite_listed(path, ".metadata", pickle.dumps(_Evil()))  # the manifest rewritten too, as an attacker would
    with pytest.raises(StateLoadError, match=r"step-00000001/\.metadata: refusing to unpickle posix\.system: not "
                                             "one of DCP's metadata types"):
        load_state(path, model, opt, CPU)
    assert not (tmp_path / "pwned").exists()


def test_another_world_size_loads_rank_0s_data_position_and_keeps_this_rngs(tmp_path):
    model, opt = _trained(0)
    path = save_state(tmp_path, 1, model, opt, {}, {"data": {"position": 3}}, CPU)
    meta = json.loads((path / "meta.json").read_text())
    rewrite_listed(path, "meta.json", json.dumps({**meta, "world_size": 4}).encode())
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    _, rank_state = load_state(path, model, opt, CPU)
    assert rank_state == {"data": {"position": 3}} and torch.equal(torch.rand(1), expected)
    rewrite_listed(path, "meta.json", json.dumps({**meta, "world_size": 4, "format_version": 2}).encode())
    with pytest.raises(StateLoadError, match=r"is a saved-state format 2 state \(experts keyed per EP rank\), which "
                                             r"resumes only on the layout that saved it \(world size 4\); this run "
                                             r"has world size 1$"):
        load_state(path, model, opt, CPU)


def test_another_parallel_layout_loads_but_not_for_a_format_2_state(tmp_path):
    model, opt = _trained(0)
    path = save_state(tmp_path, 1, model, opt, {}, {}, CPU, layout="ep 2 cp 1")
    meta = json.loads((path / "meta.json").read_text())
    assert meta["layout"] == "ep 2 cp 1" and meta["format_version"] == 3
    load_state(path, model, opt, CPU, layout="ep 1 cp 1")
    rewrite_listed(path, "meta.json", json.dumps({**meta, "format_version": 2}).encode())
    with pytest.raises(StateLoadError, match=r"resumes only on the layout that saved it \(world size 1, parallel "
                                             r"layout \[ep 2 cp 1\]\); this run has world size 1, parallel layout "
                                             r"\[ep 1 cp 1\]$"):
        load_state(path, model, opt, CPU, layout="ep 1 cp 1")
    load_state(path, model, opt, CPU, layout="ep 2 cp 1")  # the same layout loads
