"""spartron.launch: how runs start.

cli.py (the `spartron` command), local.py (N ranks on one machine), slurm.py (sbatch render, submit,
wait), smoke.py (distributed bring-up check), plan.py (layout and memory per rank before a run),
process.py (how a finished process ends).
"""
