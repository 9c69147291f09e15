"""`spartron eval`: the validation loss of a saved step on the ranks of the current launch, with the
Trainer's rank set-up (spartron.runtime.rank_setup) and the Trainer's Evaluator."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spartron.runtime.config import RunConfig
from spartron.runtime.evaluate import Evaluator, check_held_out, describe_eval_data, eval_data_origin, step_eval_config
from spartron.runtime.rank_setup import (
    ClosableModel,
    ModelFactory,
    RankModel,
    RankPlace,
    default_model_factory,
    init_process_group,
)
from spartron.runtime.rundir import check_newest_marker, marker_kind, read_manifest, read_meta
from spartron.runtime.state import (
    StateLoadError,
    latest_complete_step,
    load_state,
    lock_for_reading,
    state_config,
    step_dir,
)


def evaluate_saved(cfg: RunConfig, path: str | Path, model_factory: ModelFactory | None = None,
                   explicit: Collection[str] = ()) -> dict[str, Any]:
    """The validation loss (spartron.runtime.evaluate) of a saved step, or of a run directory's newest
    complete step (any layout: saved states are layout-free), on the data the step records unless
    `explicit` (the dotted keys given with --set) names other (step_eval_config). Returns the Evaluator's
    values with "step", "path", "data" (what was evaluated) and "notes" (one line per setting taken from
    the step instead of cfg); the run is not changed."""
    path = Path(path)
    reading = lock_for_reading(path)  # held until the end: no run starts, saves or prunes steps meanwhile
    if marker_kind(path) == "absent":  # a run directory: its newest complete step
        check_newest_marker(path)
        newest = latest_complete_step(path) if path.is_dir() else None
        if newest is None:
            raise StateLoadError(f"{path}: neither a saved step nor a run directory holding one")
        path = step_dir(path, newest)
    read_manifest(path)  # the step's data settings; load_state verifies meta.json with every other file
    saved = read_meta(path)["config"]
    cfg, notes = step_eval_config(cfg, saved, explicit, str(path / "meta.json"))
    origin = eval_data_origin(cfg, saved)
    check_held_out(cfg, origin, str(path))
    owns_pg = init_process_group(cfg)
    place = RankPlace.of(cfg)
    built = RankModel.build(cfg, place, model_factory or default_model_factory)  # the optimizer: load_state fills it
    meta, _ = load_state(path, built.model, built.optimizer, place.device, config=state_config(cfg),
                         verify_checksums=cfg.train.verify_checksums, **built.ep_state)
    groups = place.groups
    evaluator = Evaluator(cfg, groups.rank_in("dp"), place.dims.dp, place.n_micro, groups.dp_cp, place.device)
    result = evaluator.run(built.model)
    result.update(step=meta["step"], path=str(path), data=describe_eval_data(cfg, origin), notes=notes)
    if isinstance(built.model, ClosableModel):
        built.model.close()
    if owns_pg:
        dist.barrier()
        dist.destroy_process_group()
    reading.release()
    return result
