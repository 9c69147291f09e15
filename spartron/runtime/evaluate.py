"""Evaluation: the validation loss (and perplexity) of a model on the held-out split.

`train.eval_every = N` evaluates after every N-th optimizer step (and `spartron eval` a saved step) on
`train.eval_steps` batches of `train.global_batch_size` held-out sequences: the SAME sequences every
time, so the values of one run are comparable step to step, and the same for every layout (each
data-parallel rank reads its share, as in training). The value is the mean language-model loss
(MTP, auxiliary and indexer losses are training objectives, not reported here); perplexity is its
exponential.

The held-out split is the data's own (spartron.runtime.data.build_eval_loader: synthetic data's
disjoint stream, the last `train.data.val_fraction` of a token file or corpus, never trained on).

`spartron eval` of a saved step evaluates the data that step records (its meta.json: train.data.*, seed,
seq_len, global_batch_size, eval_steps; `step_eval_config`), not whatever the config it is given names: a
config file that differs is reported one line per key, and only keys given with `--set` choose other data.

An evaluation leaves the run as it found it: no gradients, dropout off, the model's buffers (the
routers' step counts that feed the expert-bias update) restored, the RNG streams untouched (a resumed
run must replay the uninterrupted one exactly).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spartron.runtime.config import ConfigError, DataConfig, RunConfig, config_from_dict
from spartron.runtime.data import build_eval_loader, check_held_out_size
from spartron.runtime.loss_norm import step_loss_norm
from spartron.runtime.saved_config import recorded_changes, state_config

# What a saved step records about the data it was trained and evaluated on (besides train.data.*, taken as one
# unit: one --set train.data.<key> makes the whole section the command line's).
EVAL_TRAIN_KEYS = ("seed", "seq_len", "global_batch_size", "eval_steps")


def _given(key: str, explicit: Collection[str]) -> bool:
    """Whether a --set key (dotted) sets `key` or a key inside it, or the table holding it."""
    return any(e == key or e.startswith(key + ".") or key.startswith(e + ".") for e in explicit)


def step_eval_config(cfg: RunConfig, saved: dict[str, Any] | None, explicit: Collection[str],
                     source: str) -> tuple[RunConfig, list[str]]:
    """(the config an evaluation of a saved step runs, one note per setting where it differs from `cfg`).

    `saved`: the step's recorded config (meta.json "config", dotted keys); `explicit`: the dotted keys given
    with --set, which win; `source`: the meta.json, named in messages. Every other recorded data setting
    is the step's: a config file naming other data is reported, not followed. The model settings are the
    config's (a step trained in FP8 may be evaluated in bf16 where FP8 does not run); one note names those
    that differ from the step's."""
    if not saved:
        return cfg, [f"spartron: note: {source} records no data settings: evaluating the config's train.data"]
    data, notes = cfg.model_dump(mode="json"), []
    recorded = {k[len("train.data."):]: v for k, v in saved.items() if k.startswith("train.data.")}
    unknown = sorted(set(recorded) - set(DataConfig.model_fields))
    if unknown:
        raise ConfigError(f"{source} records train.data.{unknown[0]}, which this Spartron does not know")
    if recorded:
        now = data["train"]["data"]
        if _given("train.data", explicit):
            if {**now, **recorded} != now:
                notes.append(f"spartron: note: train.data is given with --set: evaluating it, not the data the step "
                             f"was trained on ({_data_text(DataConfig.model_validate({**now, **recorded}))})")
        else:
            notes += [f"spartron: note: train.data.{k}: evaluating the step's {v!r}, not the config's {now.get(k)!r}"
                      for k, v in sorted(recorded.items()) if now.get(k) != v]
            data["train"]["data"] = {**now, **recorded}
    for key in EVAL_TRAIN_KEYS:
        name = f"train.{key}"
        if name not in saved or data["train"][key] == saved[name]:
            continue
        if _given(name, explicit):
            notes.append(f"spartron: note: {name} = {data['train'][key]!r} is given with --set (the step recorded "
                         f"{saved[name]!r})")
        else:
            notes.append(f"spartron: note: {name}: evaluating with the step's {saved[name]!r}, not the config's "
                         f"{data['train'][key]!r}")
            data["train"][key] = saved[name]
    try:
        evaluated = config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"the settings {source} records do not form a valid config with this one: {err}") from None
    changed = recorded_changes(saved, state_config(evaluated), "model.")  # precision, kernels: the config's
    if changed:
        notes.append("spartron: note: evaluating with model settings other than the step was trained with (its "
                     f"tensors fit): {', '.join(changed)}")
    return evaluated, notes


def _data_text(d: DataConfig) -> str:
    if d.kind == "synthetic":
        return "synthetic data"
    where = repr(d.path) if d.path else f"the blend of {d.paths!r}"
    return f"{'token file' if d.kind == 'mmap' else 'token folder'} {where}"


def eval_data_origin(cfg: RunConfig, saved: dict[str, Any] | None) -> str:
    """"step" when cfg evaluates the data the step records, "set" when --set named other data, "config" when
    the step records none."""
    recorded = {k[len("train.data."):]: v for k, v in (saved or {}).items() if k.startswith("train.data.")}
    if not recorded:
        return "config"
    now = cfg.train.data.model_dump(mode="json")
    return "step" if all(now.get(k) == v for k, v in recorded.items()) else "set"


_ORIGIN = {"step": ", held out: never trained on",
           "set": ", given with --set: not the step's data; it may hold tokens the step was trained on",
           "config": ", the config's data (the step records none)"}


def describe_eval_data(cfg: RunConfig, origin: str) -> str:
    """What an evaluation of cfg reads, as the end of 'N tokens of ...' (`origin`: eval_data_origin)."""
    d, t = cfg.train.data, cfg.train
    if d.kind == "synthetic":
        what = f"the held-out stream of synthetic data (train.seed {t.seed})"
    else:
        part = "documents" if d.kind == "packed" else "samples"
        what = f"the last {d.val_fraction:g} of the {part} of {_data_text(d)}"
    return what + _ORIGIN[origin]


def check_held_out(cfg: RunConfig, origin: str, step: str) -> None:
    """A step trained on all of its data has no held-out part: say so, naming what the user can choose."""
    d = cfg.train.data
    if origin == "step" and d.kind != "synthetic" and d.val_fraction == 0:
        raise ConfigError(f"{step} was trained on all of {_data_text(d)} (train.data.val_fraction = 0): none of it "
                          "is held out; evaluate other data with --set train.data.path=... (a --set "
                          "train.data.val_fraction=... would measure tokens it was trained on)")


class Evaluator:
    """Validation loss over a fixed held-out set; `run(model)` is a collective over `group` (dp x cp)."""

    def __init__(self, cfg, dp_rank: int, dp_size: int, n_micro: int, group: dist.ProcessGroup,  # noqa: ANN001
                 device: torch.device) -> None:
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.n_batches = cfg.train.eval_steps * n_micro  # micro-batches per rank per evaluation
        self.loader = build_eval_loader(cfg, dp_rank, dp_size)  # here: a split that is empty fails at setup
        check_held_out_size(cfg, self.loader)  # ... and one an evaluation would read round again
        self.group, self.device = group, device

    def run(self, model: nn.Module) -> dict[str, Any]:
        """{"val_loss", "val_ppl", "val_tokens" (the LM targets evaluated), "eval_time_s"}: the same values on every
        rank."""
        t = self.cfg.train
        loader = self.loader
        loader.position = 0  # the same held-out samples every time
        start = time.perf_counter()
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        was_training = model.training
        cuda = [self.device] if self.device.type == "cuda" else []
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                model.eval()
                batches = [loader.next(t.micro_batch_size) for _ in range(self.n_batches)]  # on the host
                loss_norm = step_loss_norm(model, batches, self.group, self.device)  # the token mean over them all
                for batch in batches:
                    out = model(batch.tokens.to(self.device), batch.labels.to(self.device),
                                **batch.model_kwargs(self.device),
                                **({} if loss_norm is None else {"loss_norm": loss_norm}))
                    total += out["lm_loss"].detach().double()
        finally:
            model.train(was_training)
            reshard(model)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
        if loss_norm is None:  # a model without target_counts: each micro-batch's mean weighs the same
            total /= self.n_batches
        dist.all_reduce(total, group=self.group)  # gloo has no AVG: sum, then divide
        loss = float(total) / dist.get_world_size(self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)),
                # the targets evaluated (a chat's prompt, a document's first token are none)
                "val_tokens": (t.eval_steps * t.global_batch_size * t.seq_len if loss_norm is None
                               else int(loss_norm.targets[0])),
                "eval_time_s": time.perf_counter() - start}


def reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of `model` back in its sharded state. A forward without backward leaves the root's
    parameters unsharded (FSDP2 does not reshard the root after forward), so `model.parameters()` would
    return the unsharded tensors, not the sharded ones the optimizer and the gradient clipping hold."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
