"""spartron.runtime: the training engine.

config.py (the run config: TOML, validated), trainer.py (Trainer: setup / step / close; `train`),
rank_setup.py (a rank's place and model, shared by the Trainer and `evaluate_saved` in saved_eval.py),
guards.py (the step errors and loss guards), data.py (the trainer's loaders), optim.py, state.py (saved
model state: save, load, verify), metrics.py (JSONL records and the end-of-run summary), memory.py (the
per-rank memory plan).
Names import on first use (spartron.face): the CLI's config check does not pay for the Trainer.
"""

from spartron.face import lazy_face

_NAMES = {
    "ConfigError": "config", "RunConfig": "config", "config_from_dict": "config", "dump_config": "config",
    "load_config": "config",
    "ModelFactory": "rank_setup", "TrainResult": "trainer", "Trainer": "trainer", "TrainingError": "guards",
    "evaluate_saved": "saved_eval", "train": "trainer",
    "build_optimizer": "optim",
    "StateSaveError": "state", "latest_complete_step": "state", "load_state": "state", "save_state": "state",
    "MetricsFileError": "metrics", "read_metrics": "metrics",
    "plan_memory": "memory",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_face(__name__, _NAMES)
