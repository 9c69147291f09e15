"""spartron.launch: how runs start.

cli.py (the `spartron` command: parse, dispatch), command.py (what every command shares: parser, config
argument, one-line refusals), one cmd_*.py per command group (train/smoke/eval, sbatch, regress, plan,
convert, data); local.py (N ranks on one machine), slurm.py (sbatch render, submit, wait), smoke.py
(distributed bring-up check), plan.py (layout and memory per rank before a run), regression.py (compare a
run's metrics with a baseline), process.py (how a finished process ends).
Names import on first use (spartron.face): `spartron --version` does not pay for Slurm or plotting.
"""

from spartron.face import lazy_face

_NAMES = {
    "main": "cli",
    "launch_local": "local",
    "SlurmError": "slurm", "SlurmJob": "slurm", "render_job": "slurm", "submit": "slurm", "wait": "slurm",
    "run_smoke": "smoke",
    "render_plan": "plan",
    "Tolerances": "regression", "compare_runs": "regression",
    "exit_process": "process",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_face(__name__, _NAMES)
