"""train.async_save: the tensors are copied to host memory and written in the background while training
goes on; COMPLETE is written only by the commit, after the write finished; the result loads bitwise."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from spartron.runtime.config import ConfigError, config_from_dict
from spartron.runtime.state import (
    COMPLETE,
    AsyncSaveGroup,
    complete_steps,
    incomplete_steps,
    load_state,
    start_save,
    step_dir,
)
from spartron.runtime.trainer import train
from spartron.testing import run_distributed


def _model_and_optimizer(seed: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 8)).to(device)  # ~34 MiB + AdamW: a write that lasts
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _save_train_commit(rank, world, run_dir: str, commit: bool, device: str = "cpu"):
    group = AsyncSaveGroup()
    model, opt = _model_and_optimizer(0, device)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    pending = start_save(run_dir, 1, model, opt, {"tokens": 0}, {"data": {}}, torch.device(device),
                         async_group=group)
    overlapped = not pending.done()  # start_save returned while this rank's tensors were still being written
    no_step_yet = not step_dir(run_dir, 1).exists()
    for p in model.parameters():  # the next training step changes the parameters in place
        p.grad = torch.ones_like(p)
    opt.step()
    if not commit:  # a crash mid-write: the process ends without committing
        pending.future.result()  # (let the writer thread end before the process does)
        group.destroy()
        return overlapped, no_step_yet, None
    path = pending.commit()
    fresh, fresh_opt = _model_and_optimizer(1, device)
    load_state(path, fresh, fresh_opt, torch.device(device))
    bitwise = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    group.destroy()
    return overlapped, no_step_yet, bitwise


def test_an_async_save_overlaps_the_next_step_and_loads_bitwise(tmp_path):
    results = run_distributed(_save_train_commit, 2, str(tmp_path), True, timeout=120)
    assert results == [(True, True, True)] * 2
    assert complete_steps(tmp_path) == [1] and (step_dir(tmp_path, 1) / COMPLETE).is_file()
    assert incomplete_steps(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: parameters on the GPU, staged to the host")
def test_an_async_save_of_cuda_parameters_overlaps_the_next_step_and_loads_bitwise(tmp_path):
    results = run_distributed(_save_train_commit, 1, str(tmp_path), True, "cuda", timeout=120, start_method="spawn")
    assert results == [(True, True, True)]


def test_a_crash_before_the_commit_leaves_no_complete_step(tmp_path):
    assert run_distributed(_save_train_commit, 2, str(tmp_path), False, timeout=120) == [(True, True, None)] * 2
    assert complete_steps(tmp_path) == [] and incomplete_steps(tmp_path) == [".tmp-step-00000001"]
    assert not (tmp_path / ".tmp-step-00000001" / COMPLETE).exists()


def _cfg(run_dir, **train_kw):
    base = {"steps": 4, "seq_len": 16, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-2,
            "warmup_steps": 1, "progress": False, "run_dir": str(run_dir), "peak_tflops": 1.0, "save_every": 1}
    base.update(train_kw)
    return config_from_dict({"name": "t", "device": "cpu", "model": {"vocab_size": 64, "dim": 16, "n_layers": 1},
                             "parallel": {"timeout_s": 30.0}, "train": base})


def _train(rank, world, cfg):
    result = train(cfg)
    return result.resumed_from, [(r["step"], r["loss"], r["grad_norm"]) for r in result.records]


def test_trainer_async_saves_commit_every_step_and_resume_bitwise(tmp_path):
    sync = run_distributed(_train, 2, _cfg(tmp_path / "sync"), timeout=120)[0]
    asynchronous = run_distributed(_train, 2, _cfg(tmp_path / "async", async_save=True), timeout=120)[0]
    assert asynchronous == sync
    assert complete_steps(tmp_path / "async") == [1, 2, 3, 4]
    for later in (3, 4):  # as if the run had died after step 2's commit
        shutil.rmtree(step_dir(tmp_path / "async", later))
    resumed = run_distributed(_train, 2, _cfg(tmp_path / "async", async_save=True), timeout=120)[0]
    assert resumed == (2, sync[1][2:])


def test_async_save_without_save_every_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.async_save = true needs train.save_every > 0"):
        _cfg("x", async_save=True, save_every=0)
