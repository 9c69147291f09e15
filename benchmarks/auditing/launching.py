"""Local ranks and their faults, the launcher's environment, and Slurm scripts with injection payloads."""

from __future__ import annotations

from benchmarks.auditing.core import Case, has_records, train, tstr

# Every payload mentions {m}: the marker it would create if any of it ran as shell.
HOSTILE = [
    "$(touch {m})", "`touch {m}`", "x\ntouch {m}", "'; touch {m}; echo '", '"; touch {m}; echo "',
    ";touch {m}", "a b | touch {m} && touch {m}", "$((1+1)) ${HOME} \\$(touch {m}) \\", "--x=$(touch {m})",
    "#SBATCH --wrap='touch {m}'", "x\rtouch {m}",
]


def launch_cases() -> list[Case]:
    out = []
    for nproc, rank, mode in ((2, 1, "raise"), (2, 1, "exit"), (2, 1, "kill"), (2, 1, "stop"), (2, 0, "raise"),
                              (4, 3, "raise"), (4, 2, "kill"), (4, 1, "exit")):
        extra = ["parallel.timeout_s=20"] if mode == "stop" else []
        out.append(Case(f"launch-{nproc}r-rank{rank}-{mode}", "launch",
                        train(f"launch.nproc={nproc}", "debug.fail_step=1", f"debug.fail_rank={rank}",
                              f"debug.fail_mode={mode}", *extra),
                        timeout=150.0 if mode == "stop" else 120.0, fault=f"rank {rank}",
                        quick=(nproc, mode) == (2, "exit")))
    # the launcher's environment as a careless shell or a broken launcher leaves it
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "LOCAL_RANK": "0"}
    for cid, env, names in [
        ("rank-only", {"RANK": "0"}, ("WORLD_SIZE",)),
        ("rank-abc", {"RANK": "abc", "WORLD_SIZE": "2", **master}, ("RANK",)),
        ("world-0", {"RANK": "0", "WORLD_SIZE": "0", **master}, ("WORLD_SIZE", "world size")),
        ("rank-oob", {"RANK": "5", "WORLD_SIZE": "2", **master}, ("RANK", "rank 5")),
        ("no-master", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, ("MASTER_ADDR",)),
        ("port-bad", {"RANK": "0", "WORLD_SIZE": "1", **master, "MASTER_PORT": "99999"},
         ("MASTER_PORT", "master port")),
        ("slurm-partial", {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}, ("SLURM_",)),
        ("peer-missing", {"RANK": "0", "WORLD_SIZE": "2", **master}, ("rank", "MASTER", "join", "timed out")),
        ("master-unresolvable", {"RANK": "1", "WORLD_SIZE": "2", **master, "MASTER_ADDR": "nosuchhost.invalid"},
         ("MASTER_ADDR",)),
        ("master-not-listening", {"RANK": "1", "WORLD_SIZE": "2", **master, "MASTER_PORT": "9"},
         ("MASTER_PORT",)),
    ]:
        out.append(Case(f"launch-env-{cid}", "launch", train("parallel.timeout_s=8"), names, env=env, timeout=90.0))
    return out


def slurm_cases() -> list[Case]:
    """Injection payloads in every string that reaches the job script; the script is then executed."""
    fields = {
        "name": lambda v: ["--set", f"name={tstr(v)}", "--set", "launch.job_name=job"],
        "job_name": lambda v: ["--set", f"launch.job_name={tstr(v)}"],
        "job_name_flag": lambda v: ["--job-name", v],
        "qos": lambda v: ["--qos", v],
        "partition": lambda v: ["--partition", v],
        "account": lambda v: ["--set", f"launch.account={tstr(v)}"],
        "time": lambda v: ["--time", v],
        "env_value": lambda v: ["--set", f"launch.env={{SAFE = {tstr(v)}}}"],
        "env_key": lambda v: ["--set", f"launch.env={{{tstr(v)} = \"x\"}}"],
        "venv": lambda v: ["--set", f"launch.venv={tstr('/opt/' + v)}"],
        "container": lambda v: ["--set", f"launch.container={tstr(v)}"],
        "sbatch_args": lambda v: ["--set", f"launch.sbatch_args=[{tstr('--comment=' + v)}]"],
        "run_dir": lambda v: ["--set", f"train.run_dir={tstr('/tmp/audit-' + v)}"],
    }
    # A value that is data (an env value, a venv path) may be accepted once shell-quoted.
    data_fields = {"env_value", "venv", "container"}
    out = []
    for fname, make in fields.items():
        for i, payload in enumerate(HOSTILE):
            multiline = "\n" in payload or "\r" in payload
            out.append(Case(f"slurm-{fname}-{i}", "slurm", ["sbatch", "{tiny}", "--dry-run", *make(payload)],
                            (fname if fname not in ("env_value", "env_key") else "launch.env", fname.replace("_", "-"),
                             "launch.job_name",
                             "launch." + fname, "name", "train.run_dir", "directive", "Slurm"),
                            run_script=True, accept_ok=fname in data_fields and not multiline,
                            quick=(fname, i) in (("name", 2), ("env_value", 0))))
    # refused before anything is written or submitted (a stub sbatch call fails the case)
    for cid, arg, names in (("signal", "--signal=USR1@120", ("launch.sbatch_args", "launch.signal_before_s")),
                            ("signal-abbrev", "--sig=USR1@120", ("launch.sbatch_args", "launch.signal_before_s")),
                            ("array", "--array=0-1", ("launch.sbatch_args",))):
        out.append(Case(f"slurm-sbatch-args-{cid}", "slurm",
                        ["sbatch", "{tiny}", "--submit", "--set", f"launch.sbatch_args=[{tstr(arg)}]"], names,
                        forbid_submit=True))
    live = train("train.steps=12", "train.save_every=2", "name=live")
    out.append(Case("slurm-sbatch-into-a-live-run-dir", "slurm", ["sbatch", "{tiny}", "--submit", "--set", "name=live"],
                    (".lock", "in use"), category="concurrent", first=live,
                    first_ready=has_records("runs/live/metrics.jsonl", 1), forbid_submit=True, timeout=150.0,
                    note="a submission must not rewrite the job files of a run training there (F1)"))
    return out
