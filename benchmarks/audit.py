"""The bad-input audit: hundreds of bad inputs and faults, each run through the real `spartron` CLI in a
subprocess with a timeout, classified automatically.

    python benchmarks/audit.py                      # all cases -> benchmarks/results/audit.{md,json}
    python benchmarks/audit.py --only slurm,data    # some areas (results not written unless --out)
    python benchmarks/audit.py --quick              # the subset tests/test_audit.py runs

Areas: config (TOML file and --set), cli (flags), data (token files), state (saved steps, corrupt and
hostile), launch (local ranks, the [debug] fault hook), slurm (sbatch render with injection payloads:
the rendered script is executed with stub srun/sbatch/scontrol/sacct on PATH).

Classes, decided from the exit status, the output and the case's folder:
- clear: exit status != 0, one `spartron: error:` line naming the key or path the case is about, no
  traceback (fault cases: a non-zero exit and a report naming the failing rank);
- unclear: non-zero without a traceback, but not one line or not naming the key/path;
- traceback: a Python traceback reached the user;
- silently accepted: exit status 0 for an input that should have been refused;
- accepted safely: exit 0 where accepting is right (a value that is data, shell-quoted), with the case's
  check passed (e.g. the rendered script ran only the stubs);
- hang: the timeout expired;
- harmful: a marker file a payload would create exists, something was written outside the case's work
  folder, or a stub saw an unexpected submission.
Each case runs in `<root>/<id>/work` (its cwd); payloads name the marker `<root>/<id>/pwned`; anything
new in `<root>/<id>` besides `work` is a write outside the run's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
CLASSES = ("clear", "accepted safely", "unclear", "traceback", "silently accepted", "hang", "harmful")
INFO_PREFIXES = ("spartron: launching", "spartron: note:", "spartron: resumed", "spartron: skipping",
                 "spartron: submitted", "spartron: job ")

# Every payload mentions {m}: the marker it would create if any of it ran as shell.
HOSTILE = [
    "$(touch {m})", "`touch {m}`", "x\ntouch {m}", "'; touch {m}; echo '", '"; touch {m}; echo "',
    ";touch {m}", "a b | touch {m} && touch {m}", "$((1+1)) ${HOME} \\$(touch {m}) \\", "--x=$(touch {m})",
    "#SBATCH --wrap='touch {m}'", "x\rtouch {m}",
]

STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$(basename "$0")" in
  sbatch) echo 4242 ;;
  scontrol) echo "JobId=4242 JobState=COMPLETED ExitCode=0:0" ;;
  sacct) echo "COMPLETED|0:0" ;;
esac
exit 0
"""


@dataclass
class Case:
    id: str
    area: str
    argv: list[str]  # after `spartron`; {dir} = work folder, {m} = marker, {tiny} = tiny preset
    names: tuple[str, ...] = ()  # the error must name one of these (a dotted key, a flag, a path part)
    setup: Callable[[Path], None] | None = None  # prepares the work folder (argv already formatted)
    timeout: float = 60.0
    accept_ok: bool = False  # exit 0 is right for this input (then `check` must pass)
    fault: str | None = None  # a fault case: the report must contain this text
    run_script: bool = False  # slurm: execute the rendered script (stdout) with the stubs
    forbid_submit: bool = False  # a stub sbatch call is a failure (validated before submission)
    expect_out: str | None = None  # text the output must contain for `clear` / `accepted safely`
    quick: bool = False
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)  # extra environment (a launcher's variables)
    harm: Callable[[Path], str | None] | None = None  # extra harm check on the case folder (None: no harm)


@dataclass
class Result:
    id: str
    area: str
    cls: str
    rc: int | None
    seconds: float
    detail: str
    argv: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ cases
def _set(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


def plan(*overrides: str) -> list[str]:
    return ["plan", "{tiny}", *_set(*overrides)]


def train(*overrides: str) -> list[str]:
    return ["train", "{tiny}", *_set("train.steps=1", "train.progress=false", "train.peak_tflops=1.0",
                                     *overrides)]


def tstr(value: str) -> str:
    """A TOML basic string literal for an override value."""
    return json.dumps(value)


def config_cases() -> list[Case]:
    cases: list[Case] = []

    def add(cid, overrides, names, quick=False, note=""):
        cases.append(Case(f"config-{cid}", "config", plan(*overrides), tuple(names), quick=quick, note=note))

    # strings: newline, carriage return, NUL in every kind of string option
    strings = {
        "name": "name={v}", "run_dir": "train.run_dir={v}", "venv": "launch.venv={v}",
        "container": "launch.container={v}", "partition": "launch.partition={v}",
        "account": "launch.account={v}", "job_name": "launch.job_name={v}", "time": "launch.time={v}",
        "env_value": "launch.env={{A = {v}}}", "env_key": "launch.env={{{v} = \"x\"}}",
        "sbatch_args": "launch.sbatch_args=[{v}]", "order": "parallel.order={v}",
    }
    for key, template in strings.items():
        dotted = template.split("=", 1)[0]
        for cname, char in (("nl", "\n"), ("cr", "\r"), ("nul", "\0"), ("esc", "\x1b")):
            add(f"{key}-{cname}", [template.format(v=tstr(f"/abs/a{char}b"))], [dotted],
                quick=(key, cname) == ("name", "nl"))
    add("ac_target-nl", ["ac.targets=[\"aten::mm\\n\"]"], ["ac.targets"])
    add("data_path-nul", ["train.data.kind=mmap", "train.data.path=\"/x\\u0000y\""], ["train.data.path"])
    # run names and dirs
    for cid, name in (("dotdot", "../../x"), ("empty", ""), ("slash", "a/b"), ("dot", "."), ("dots", ".."),
                      ("backslash", "a\\b"), ("spaces", "   "), ("leading-space", " x"), ("long", "x" * 10_000),
                      ("abs", "/etc")):
        add(f"name-{cid}", [f"name={tstr(name)}"], ["name"])
    add("run_dir-escape", ["train.run_dir=../../elsewhere"], ["train.run_dir"])
    add("run_dir-empty", ['train.run_dir=""'], ["train.run_dir"])
    add("run_dir-too-long", [f'train.run_dir="/tmp/{"r" * 300}"'], ["train.run_dir"])
    # non-finite floats
    floats = ["train.lr", "train.weight_decay", "train.grad_clip", "train.min_lr_ratio", "train.peak_tflops",
              "parallel.timeout_s", "model.norm_eps", "model.init_std", "model.mla.rope_theta",
              "model.moe.route_scale", "model.moe.bias_update_rate", "model.moe.aux_loss_coeff",
              "model.mtp.loss_scale", "train.beta1", "train.beta2"]
    for key in floats:
        add(f"{key}-inf", [f"{key}=inf"], [key])
    for key in floats[:6]:
        add(f"{key}-nan", [f"{key}=nan"], [key])
    add("lr--inf", ["train.lr=-inf"], ["train.lr"])
    # out of range
    for cid, item, key in [
        ("beta1-1", "train.beta1=1.0", "train.beta1"), ("beta2-neg", "train.beta2=-0.5", "train.beta2"),
        ("beta1-big", "train.beta1=1.5", "train.beta1"), ("norm_eps-neg", "model.norm_eps=-1e-6", "model.norm_eps"),
        ("norm_eps-0", "model.norm_eps=0", "model.norm_eps"),
        ("init_std-neg", "model.init_std=-0.02", "model.init_std"),
        ("init_std-0", "model.init_std=0.0", "model.init_std"), ("lr-0", "train.lr=0", "train.lr"),
        ("lr-neg", "train.lr=-1e-3", "train.lr"), ("seed-neg", "train.seed=-1", "train.seed"),
        ("seed-huge", f"train.seed={2**64}", "train.seed"), ("steps-0", "train.steps=0", "train.steps"),
        ("seq_len-1", "train.seq_len=1", "train.seq_len"),
        ("gbs-0", "train.global_batch_size=0", "train.global_batch_size"),
        ("mbs-0", "train.micro_batch_size=0", "train.micro_batch_size"),
        ("timeout-0", "parallel.timeout_s=0", "parallel.timeout_s"),
        ("cp-0", "parallel.cp=0", "parallel.cp"), ("ep-0", "parallel.ep=0", "parallel.ep"),
        ("fsdp-0", "parallel.fsdp=0", "parallel.fsdp"), ("fsdp--2", "parallel.fsdp=-2", "parallel.fsdp"),
        ("n_layers-0", "model.n_layers=0", "model.n_layers"), ("vocab-1", "model.vocab_size=1", "model.vocab_size"),
        ("dim-0", "model.dim=0", "model.dim"), ("min_lr-2", "train.min_lr_ratio=2", "train.min_lr_ratio"),
        ("warmup-neg", "train.warmup_steps=-1", "train.warmup_steps"),
        ("save_every-neg", "train.save_every=-1", "train.save_every"),
        ("topk-gt-experts", "model.moe.top_k=9", "model.moe.top_k"),
        ("groups-no-divide", "model.moe.n_groups=3", "model.moe.n_groups"),
        ("topk_groups-gt", "model.moe.topk_groups=3", "model.moe.topk_groups"),
        ("rope-odd", "model.mla.qk_rope_head_dim=7", "model.mla.qk_rope_head_dim"),
        ("first_k_dense-gt", "model.first_k_dense=5", "model.first_k_dense"),
        ("experts-ep", "parallel.ep=3", "parallel.ep"),
        ("rope_theta-1", "model.mla.rope_theta=1.0", "model.mla.rope_theta"),
        ("yarn-0", "model.mla.yarn={factor = 0.0}", "model.mla.yarn.factor"),
        ("nccl-ctas", "parallel.nccl.ep={min_ctas = 8, max_ctas = 2}", "min_ctas"),
        ("nproc-0", "launch.nproc=0", "launch.nproc"),
        ("gpus-neg", "launch.gpus_per_node=-1", "launch.gpus_per_node"),
        ("deepep_sms-1", "model.moe.deepep_num_sms=1", "model.moe.deepep_num_sms"),
        ("dsa_topk-0", "model.dsa.index_topk=0", "model.dsa.index_topk"),
        ("mtp-neg", "model.mtp.depth=-1", "model.mtp.depth"),
    ]:
        add(cid, [item], [key])
    # wrong types, unknown keys, bad literals
    for cid, item, key in [
        ("steps-str", "train.steps=ten", "train.steps"), ("lr-str", 'train.lr="fast"', "train.lr"),
        ("mode-int", "ac.mode=1", "ac.mode"), ("section-scalar", "parallel=3", "parallel"),
        ("section-list", "model.moe=[1]", "model.moe"), ("bool-int", "train.compile=1", "train.compile"),
        ("int-float", "train.steps=1.5", "train.steps"), ("bool-str", "train.resume=yes", "train.resume"),
        ("unknown-top", "bogus=1", "bogus"), ("unknown-model", "model.bogus=1", "model.bogus"),
        ("unknown-data", "train.data.bogus=1", "train.data.bogus"),
        ("misspelt", "train.learning_rate=1e-3", "train.learning_rate"),
        ("env-name", 'launch.env={"1A" = "x"}', "launch.env"), ("env-rank", 'launch.env={RANK = "0"}', "RANK"),
        ("env-slurm", 'launch.env={SLURM_PROCID = "0"}', "SLURM_PROCID"), ("device", "device=tpu", "device"),
        ("optimizer", "train.optimizer=sgd", "train.optimizer"), ("ac-mode", "ac.mode=partial", "ac.mode"),
        ("dispatcher", "model.moe.dispatcher=magic", "model.moe.dispatcher"),
        ("dtype", "model.dtype=float16", "model.dtype"),
        ("order", "parallel.order=tp-cp-ep-dp", "parallel.order"),
        ("backend", "parallel.backend=mpi", "parallel.backend"),
        ("nccl-group", "parallel.nccl.bogus={max_ctas = 2}", "parallel.nccl"),
        ("nccl-gloo", "parallel.backend=gloo", "parallel.nccl"),
    ]:
        extra = ["parallel.nccl.ep={max_ctas = 2}"] if cid == "nccl-gloo" else []
        add(cid, [*extra, item], [key])
    # options that would be ignored, and contradictions
    for cid, items, key in [
        ("data_path-synthetic", ["train.data.path=/tmp/x.bin"], "train.data.path"),
        ("token_dtype-synthetic", ["train.data.token_dtype=uint32"], "train.data.token_dtype"),
        ("mmap-no-path", ["train.data.kind=mmap"], "train.data.path"),
        ("offload-window-off", ["offload.window=[0]"], "offload.window"),
        ("offload-keep_last-off", ["offload.keep_last=3"], "offload.keep_last"),
        ("offload-pool-0", ["offload.enabled=true", "offload.pool_max_bytes=0"], "offload.pool_max_bytes"),
        ("offload-min-gt-pool", ["offload.enabled=true", "offload.min_bytes=10", "offload.pool_max_bytes=5"],
         "offload.min_bytes"),
        ("offload-prefetch-0", ["offload.enabled=true", "offload.prefetch_depth=0"], "offload.prefetch_depth"),
        ("offload-no-ac", ["ac.mode=none", "offload.enabled=true"], "offload.enabled"),
        ("ac-freq-none", ["ac.mode=none", "ac.freq=2"], "ac.freq"),
        ("ac-targets-full", ["ac.mode=full", "ac.targets=[\"aten::mm\"]"], "ac.targets"),
        ("ac-target-bogus-op", ["ac.targets=[\"aten::bogus_op\"]"], "aten::bogus_op"),
        ("ac-target-overload", ["ac.targets=[\"aten::mm.bogus\"]"], "aten::mm.bogus"),
        ("ac-target-namespace", ["ac.targets=[\"nonexistent_ns\"]"], "nonexistent_ns"),
        ("ac-target-empty", ["ac.targets=[\"\"]"], "ac.targets"),
        ("ac-target-marker", ["ac.targets=[\"profiler\"]"], "ac.targets"),
        ("compile-ac", ["train.compile=true"], "train.compile"),
        ("imb-divide", ["train.intra_layer_micro_batches=3", "train.micro_batch_size=4"],
         "train.intra_layer_micro_batches"),
        ("imb-tokens", ["train.intra_layer_micro_batches=100", "train.intra_layer_micro_batch_scope=experts",
                        "train.seq_len=64"], "train.intra_layer_micro_batches"),
        ("imb-batch-aux", ["train.intra_layer_micro_batches=2", "train.micro_batch_size=2",
                           "model.moe.aux_loss_coeff=0.1", "model.moe.aux_loss_type=batch"], "model.moe.aux_loss_type"),
        ("seq-max", ["train.seq_len=512"], "model.max_seq_len"),
        ("cp-seq", ["parallel.cp=2", "train.seq_len=30"], "train.seq_len"),
        ("dsa-index-dim", ["model.dsa.index_head_dim=4"], "model.dsa.index_head_dim"),
        ("dsa-dup", ["model.dsa.layers=[1, 1]"], "model.dsa.layers"),
        ("dsa-none", ["model.first_k_dense=4", "model.mtp.depth=0"], "model.dsa.layers"),
        ("dsa-range", ["model.dsa.layers=[7]"], "model.dsa.layers"),
        ("dsa-kl-coeff", ["model.dsa.indexer_mode=kl_dense"], "model.dsa.indexer_loss_coeff"),
        ("dsa-frozen-coeff", ["model.dsa.indexer_loss_coeff=1.0"], "model.dsa.indexer_loss_coeff"),
        ("transport-dispatcher", ["model.moe.dispatcher=deepep", "model.moe.all_to_all_transport=copy_engine"],
         "model.moe.all_to_all_transport"),
        ("sync-transport", ["model.moe.copy_engine_sync=stream_wait"], "model.moe.copy_engine_sync"),
        ("local-ep", ["model.moe.dispatcher=local", "parallel.ep=2"], "model.moe.dispatcher"),
        ("debug-rank-no-step", ["debug.fail_rank=1"], "debug.fail_rank"),
        ("partition-space", ["launch.partition=\"a b\""], "launch.partition"),
        ("time-bad", ["launch.time=forever"], "launch.time"),
        ("sbatch-arg-space", ["launch.sbatch_args=[\"--wrap=a b\"]"], "launch.sbatch_args"),
        ("venv-empty", ["launch.venv=\" \""], "launch.venv"),
        ("compile-backend-off", ["train.compile_backend=aot_eager"], "train.compile_backend"),
        ("yarn-betas", ["model.mla.yarn={beta_fast = 1.0, beta_slow = 32.0}"], "model.mla.yarn.beta_fast"),
        ("yarn-factor", ["model.mla.yarn={factor = 0.5}"], "model.mla.yarn.factor"),
    ]:
        add(cid, items, [key], quick=cid == "dsa-index-dim")
    # override syntax
    for cid, item, key in [("no-equals", "nonsense", "nonsense"), ("empty-key", "=1", "=1"),
                           ("empty-part", "a..b=1", "a..b"), ("value-not-section", "train.steps.x=1", "train.steps"),
                           ("deep-value", "train.lr=" + "[" * 5000, "train.lr"),
                           ("replace-table", "train={steps = 1}", "train"),
                           ("replace-dsa", "model.dsa={}", "model.dsa")]:
        add(f"override-{cid}", [item], [key])
    return cases


def _write(path: Path, data: bytes) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_bytes(data)
    return setup


def config_file_cases() -> list[Case]:
    base = Path(TINY).read_bytes()
    out = []

    def add(cid, data: bytes | None, names=("bad.toml",), path="bad.toml", quick=False):
        names = (*names, "bad.toml")
        out.append(Case(f"file-{cid}", "config", ["plan", path], names,
                        setup=_write(Path(path), data) if data is not None else None, quick=quick))

    add("binary", bytes(range(256)) * 4, quick=True)
    out.append(Case("file-bom", "config", ["plan", "bom.toml"], accept_ok=True,
                    setup=_write(Path("bom.toml"), b"\xef\xbb\xbf" + base)))
    add("latin1", "name = \"caf\xe9\"\n".encode("latin-1"))
    add("utf16", "name = \"x\"\n".encode("utf-16"))
    add("syntax", b"[train\nsteps = 1\n")
    add("duplicate-key", b"name = \"a\"\nname = \"b\"\n")
    add("deep-nesting", b"v = " + b"[" * 50_000)
    add("nul-in-string", b"name = \"a\x00b\"\n")
    add("newline-key", b"[model]\n\"a\\nb\" = 1\n", names=("model.",))
    add("unknown-section", base + b"\n[bogus]\nx = 1\n", names=("bogus",))
    add("wrong-type", base.replace(b"steps = 5", b"steps = \"five\""), names=("train.steps",))
    add("huge-int", base.replace(b"steps = 5", b"steps = 99999999999999999999999"), names=("train.steps",))
    out.append(Case("file-missing", "config", ["plan", "nope.toml"], ("nope.toml",)))
    out.append(Case("file-name-too-long", "config", ["plan", "a" * 5000], ("aaaa",)))
    out.append(Case("file-link-loop", "config", ["plan", "loop1"], ("loop1",),
                    setup=lambda w: ((w / "loop1").symlink_to("loop2"), (w / "loop2").symlink_to("loop1"))))
    out.append(Case("file-directory", "config", ["plan", "."], ("'.'",)))
    out.append(Case("file-dev-zero", "config", ["plan", "/dev/zero"], ("/dev/zero",), timeout=30))
    out.append(Case("file-fifo", "config", ["plan", "fifo.toml"], ("fifo.toml",), timeout=30,
                    setup=lambda w: os.mkfifo(w / "fifo.toml")))
    return out


def cli_cases() -> list[Case]:
    out = []

    def add(cid, argv, names, quick=False, **kw):
        out.append(Case(f"cli-{cid}", "cli", argv, tuple(names), quick=quick, **kw))

    add("no-command", [], ["COMMAND"])
    add("bad-command", ["frobnicate"], ["frobnicate"])
    add("unknown-flag", ["plan", "{tiny}", "--bogus"], ["--bogus"])
    add("plan-world-0", ["plan", "{tiny}", "--world-size", "0"], ["--world-size"])
    add("plan-world-neg", ["plan", "{tiny}", "--world-size", "-2"], ["--world-size"])
    add("plan-world-str", ["plan", "{tiny}", "--world-size", "x"], ["--world-size"])
    add("plan-world-huge", ["plan", "{tiny}", "--world-size", str(10**12)], ["world size", "--world-size"], timeout=60)
    add("plan-world-odd", ["plan", "{tiny}", "--world-size", "3", "--set", "parallel.cp=2"], ["parallel"])
    add("plan-max-groups-0", ["plan", "{tiny}", "--max-groups", "0"], ["--max-groups"])
    add("set-missing-value", ["plan", "{tiny}", "--set"], ["--set"])
    for flag, value in (("--nodes", "0"), ("--nodes", "-1"), ("--gpus-per-node", "-1"), ("--cpus-per-task", "0"),
                        ("--time", "forever"), ("--job-name", "$(touch {m})"), ("--partition", "a;touch {m}"),
                        ("--account", "`touch {m}`"), ("--qos", "x y"), ("--entry", "bogus"), ("--nodes", "x")):
        cid = f"sbatch{flag}-{value[:6]}".replace("$", "").replace("(", "").replace("`", "").replace(";", "")
        add(cid, ["sbatch", "{tiny}", "--dry-run", flag, value], [flag, flag[2:].replace("-", "_")])
    add("sbatch-dry-wait", ["sbatch", "{tiny}", "--dry-run", "--wait"], ["--wait"])
    add("sbatch-batch", ["sbatch", "{tiny}", "--submit", "--nodes", "3"], ["train.global_batch_size"],
        forbid_submit=True)
    add("sbatch-deepep-cpu", ["sbatch", "{tiny}", "--submit", "--set", "model.moe.dispatcher=deepep"],
        ["model.moe.dispatcher"], forbid_submit=True)
    add("sbatch-offload-window", ["sbatch", "{tiny}", "--submit", "--set", "offload.enabled=true", "--set",
                                  "offload.window=[8]"], ["offload.window"], forbid_submit=True)
    add("sbatch-data-cpu-cuda", ["sbatch", "{tiny}", "--submit", "--set", "device=cuda"], ["device"],
        forbid_submit=True)
    add("sbatch-wait-timeout-neg", ["sbatch", "{tiny}", "--submit", "--wait", "--wait-timeout", "-5"],
        ["--wait-timeout"], forbid_submit=True, quick=True)
    add("sbatch-wait-timeout-nan", ["sbatch", "{tiny}", "--submit", "--wait", "--wait-timeout", "nan"],
        ["--wait-timeout"], forbid_submit=True)
    add("sbatch-wait-timeout-nowait", ["sbatch", "{tiny}", "--submit", "--wait-timeout", "10"],
        ["--wait-timeout"], forbid_submit=True)
    add("regress-missing", ["regress", "compare", "nope", "nope2"], ["nope"])
    add("regress-too-long", ["regress", "compare", "n" * 5000, "b"], ["nnnn"])
    add("regress-garbage", ["regress", "compare", "g.jsonl", "g.jsonl"], ["g.jsonl"],
        setup=_write(Path("g.jsonl"), b"{not json\n\x00\xff"))
    add("regress-empty", ["regress", "compare", "e.jsonl", "e.jsonl"], ["e.jsonl"], setup=_write(Path("e.jsonl"), b""),
        expect_out="[FAIL] steps: the baseline has no step records")
    add("regress-wrong-records", ["regress", "compare", "w.jsonl", "w.jsonl"], ["w.jsonl"],
        setup=_write(Path("w.jsonl"), b'{"type": "step", "step": "x"}\n[1, 2]\n'))
    add("regress-loss-rel-neg", ["regress", "compare", "nope", "nope", "--loss-rel", "-1"], ["--loss-rel", "nope"])
    add("regress-loss-rel-nan", ["regress", "compare", "m.jsonl", "m.jsonl", "--loss-rel", "nan"], ["--loss-rel"],
        setup=_write(Path("m.jsonl"), b""))
    add("regress-repeats-0", ["regress", "run", "{tiny}", "--repeats", "0"], ["--repeats"])
    add("regress-repeats-1", ["regress", "run", "{tiny}"], ["--repeats", "--baseline"])
    add("smoke-bad-config", ["smoke", "{tiny}", "--set", "train.lr=inf"], ["train.lr"])
    return out


def data_cases() -> list[Case]:
    import numpy as np

    def tokens(name, values, dtype="uint16"):
        return _write(Path(name), np.asarray(values, dtype=dtype).tobytes())

    big = np.zeros(3 << 20, dtype=np.uint16)
    big[-1] = 60_000
    mid = np.zeros(3 << 20, dtype=np.uint16)
    mid[(3 << 20) * 2 // 3] = 9_999
    out = []

    def add(cid, path, setup=None, extra=(), quick=False, timeout=90.0, names=("train.data.path",)):
        out.append(Case(f"data-{cid}", "data", train("train.data.kind=mmap", f"train.data.path={tstr(path)}", *extra),
                        names, setup=setup, quick=quick, timeout=timeout))

    add("missing", "missing.bin", quick=True)
    add("directory", ".")
    add("empty", "empty.bin", _write(Path("empty.bin"), b""))
    add("odd-size", "odd.bin", _write(Path("odd.bin"), b"\x01\x00\x02"))
    add("short", "short.bin", tokens("short.bin", range(10)))
    add("u16-as-u32", "u16.bin", tokens("u16.bin", [1, 2] * 200), extra=("train.data.token_dtype=uint32",))
    add("oov-tail", "tail.bin", _write(Path("tail.bin"), big.tobytes()))
    add("oov-middle", "mid.bin", _write(Path("mid.bin"), mid.tobytes()))
    add("oov-head", "head.bin", tokens("head.bin", [600] * 1000))
    add("u32-as-u16", "u32.bin", tokens("u32.bin", [i % 500 + 1 for i in range(4000)], dtype="uint32"))
    add("u16-big-vocab", "v.bin", tokens("v.bin", range(1000)), extra=("model.vocab_size=129280",),
        names=("train.data.token_dtype",))
    add("dev-zero", "/dev/zero")
    add("too-long", "d" * 5000)
    add("symlink-dir", "link", lambda w: (w / "link").symlink_to(w))
    return out + packed_cases()


def _token_folder(name: str, n: int = 200, edit: Callable[[dict], None] | None = None, ids: int = 2,
                  raw_meta: bytes | None = None, short: bool = False,
                  offsets: list[int] | None = None) -> Callable[[Path], None]:
    """A `spartron data` folder of n tokens (id `ids` + i % 30) in two documents, its tokens.json edited."""
    import numpy as np

    def setup(work: Path) -> None:
        d = work / name
        d.mkdir(parents=True)
        np.asarray([ids + i % 30 for i in range(n - (10 if short else 0))], dtype=np.uint16).tofile(d / "tokens.bin")
        np.asarray(offsets or [0, n // 2, n], dtype=np.int64).tofile(d / "documents.bin")
        meta = {"format": "spartron-tokens", "version": 1, "dtype": "uint16", "vocab_size": 512, "eos_id": 1,
                "bos_id": None, "tokenizer": {"sha256": "0" * 64}, "n_tokens": n, "n_documents": 2,
                "loss_mask": None, "documents": "documents.bin", "corpus": {}}
        if edit is not None:
            edit(meta)
        (d / "tokens.json").write_bytes(raw_meta if raw_meta is not None else json.dumps(meta).encode())
    return setup


def _tokenizer(work: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on a mat"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok.save(str(work / "tokenizer.json"))
    (work / "corpus").mkdir()
    (work / "corpus" / "a.jsonl").write_text('{"text": "the cat"}\n')


def packed_cases() -> list[Case]:
    """train.data.kind = "packed" folders that are wrong, and `spartron data` given wrong inputs."""
    out = []

    def add(cid, setup, extra=(), names=("train.data.path", "tokens.json"), path="tok"):
        out.append(Case(f"data-packed-{cid}", "data", train("train.data.kind=packed", f"train.data.path={tstr(path)}",
                                                            *extra), names, setup=setup, timeout=90.0))

    def only_bin(w: Path) -> None:
        (w / "tok").mkdir()
        (w / "tok" / "tokens.bin").write_bytes(b"\x01\x00" * 100)

    add("no-meta", only_bin)
    add("meta-garbage", _token_folder("tok", raw_meta=b"\x00\xff{"))
    add("meta-deep", _token_folder("tok", raw_meta=b"[" * 100_000))
    add("meta-list", _token_folder("tok", raw_meta=b"[]"))
    add("offsets-falling", _token_folder("tok", offsets=[0, 150, 100]), names=("documents.bin",))
    add("documents-traversal", _token_folder("tok", edit=lambda m: m.update(documents="../../etc/passwd")))
    add("n-tokens-huge", _token_folder("tok", edit=lambda m: m.update(n_tokens=2**62)))
    add("truncated-bin", _token_folder("tok", short=True))
    add("mask-traversal", _token_folder("tok", edit=lambda m: m.update(loss_mask="../../etc/passwd")),
        names=("loss_mask",))
    add("vocab-above-model", _token_folder("tok", edit=lambda m: m.update(vocab_size=60_000)),
        names=("model.vocab_size",))
    add("ids-above-vocab", _token_folder("tok", ids=600), names=("model.vocab_size",))  # tokens.json lies
    add("val-split-too-short", _token_folder("tok", n=100), extra=("train.data.val_fraction=0.5",),
        names=("train.seq_len",))
    add("is-a-file", _write(Path("tok"), b"x"))
    add("dtype-set", _token_folder("tok"), extra=("train.data.token_dtype=uint32",), names=("train.data.token_dtype",))

    def data(cid, argv, names, setup=_tokenizer):
        out.append(Case(f"data-prepare-{cid}", "data", ["data", *argv], tuple(names), setup=setup, timeout=60.0))

    base = ["corpus", "--tokenizer", "tokenizer.json", "--eos", "<eos>", "--out"]
    data("corpus-missing", ["nope", "--tokenizer", "tokenizer.json", "--eos", "<eos>", "--out", "o"], ["nope"])
    data("tokenizer-missing", ["corpus", "--tokenizer", "none.json", "--out", "o"], ["none.json"])
    data("tokenizer-garbage", ["corpus", "--tokenizer", "corpus/a.jsonl", "--eos", "x", "--out", "o"], ["a.jsonl"])
    data("eos-hostile", ["corpus", "--tokenizer", "tokenizer.json", "--eos", "$(touch {m})", "--out", "o"], ["EOS"])
    data("no-eos", ["corpus", "--tokenizer", "tokenizer.json", "--out", "o"], ["--eos"])
    data("out-not-empty", [*base, "corpus"], ["corpus"])

    def bad_corpus(w: Path) -> None:
        _tokenizer(w)
        (w / "corpus" / "b.jsonl").write_bytes(b'{"text": "a"}\n{"messages": [{"role": "$(touch ' + b"x" + b')"}]}\n')

    data("bad-record", [*base, "o"], ["b.jsonl:2"], setup=bad_corpus)
    return out


def runtime_cases() -> list[Case]:
    out = []

    def add(cid, overrides, names, quick=False, timeout=90.0):
        out.append(Case(f"runtime-{cid}", "config", train(*overrides), tuple(names), quick=quick, timeout=timeout))

    add("deepep-cpu", ["model.moe.dispatcher=deepep"], ["model.moe.dispatcher"], quick=True)
    add("copy-engine-cpu", ["model.moe.all_to_all_transport=copy_engine"], ["model.moe.all_to_all_transport"])
    add("nccl-cpu", ["parallel.backend=nccl"], ["parallel.backend"])
    add("nccl-settings-cpu", ["parallel.nccl.ep={max_ctas = 2}"], ["parallel.nccl"])
    add("cuda-absent", ["device=cuda"], ["device"])
    add("offload-window", ["offload.enabled=true", "offload.window=[0, 9]"], ["offload.window"])
    add("offload-dup", ["offload.enabled=true", "offload.window=[1, 1]"], ["offload.window"])
    add("offload-keep-all", ["offload.enabled=true", "offload.keep_last=5"], ["offload.keep_last"])
    add("batch-divide", ["launch.nproc=2", "train.global_batch_size=3"], ["train.global_batch_size"])
    add("batch-mbs", ["train.micro_batch_size=8"], ["train.global_batch_size"])
    add("nproc-cp", ["launch.nproc=3", "parallel.cp=2"], ["parallel"])
    add("nproc-huge", ["launch.nproc=1000"], ["train.global_batch_size", "parallel", "launch.nproc"])
    add("nproc-fork-bomb", ["launch.nproc=100000", "train.global_batch_size=100000"], ["launch.nproc"])
    add("run_dir-file", ["train.run_dir=\"{dir}/afile\""], ["train.run_dir"])
    add("run_dir-under-file", ["train.run_dir=\"{dir}/afile/sub\""], ["train.run_dir"])
    add("debug-rank-oob", ["launch.nproc=2", "debug.fail_step=1", "debug.fail_rank=5"], ["debug.fail_rank"])
    add("debug-step-oob", ["debug.fail_step=9"], ["debug.fail_step"])
    for case in out:
        if "afile" in " ".join(case.argv):
            case.setup = _write(Path("afile"), b"x")
    return out


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
    return out


def state_cases() -> list[Case]:
    """Corrupt and hostile saved steps; each case gets a copy of a real 2-step run (save_every 1)."""
    resume = train("train.steps=3", "train.save_every=1", "name=base")
    out = []

    def add(cid, mutate, names=("step-",), argv=None, accept_ok=False, expect_out=None, quick=False):
        out.append(Case(f"state-{cid}", "state", argv or resume, tuple(names), setup=mutate, timeout=120.0,
                        accept_ok=accept_ok, expect_out=expect_out, quick=quick))

    def step2(w: Path) -> Path:
        return w / "runs" / "base" / "step-00000002"

    def file_op(pattern: str, op: Callable[[Path], None]) -> Callable[[Path], None]:
        def mutate(w: Path) -> None:
            for path in sorted(step2(w).glob(pattern))[:1]:
                op(path)
        return mutate

    truncate = lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])  # noqa: E731
    empty = lambda p: p.write_bytes(b"")  # noqa: E731
    garbage = lambda p: p.write_bytes(os.urandom(max(64, p.stat().st_size)))  # noqa: E731

    def flip(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))

    for pattern in (".metadata", "*.distcp", "meta.json", "rank-00000.json", "rank-00000.pt", "COMPLETE"):
        for oname, op in (("truncate", truncate), ("empty", empty), ("garbage", garbage), ("flip", flip)):
            if pattern == "COMPLETE" and oname == "flip":
                continue
            add(f"{pattern.strip('*.')}-{oname}", file_op(pattern, op), names=("step-00000002", pattern.strip("*")),
                quick=False)
    # the same garbage with the COMPLETE manifest rewritten to match (whoever can write the files can):
    # the loaders themselves must refuse
    for pattern in (".metadata", "*.distcp", "meta.json", "rank-00000.json", "rank-00000.pt"):
        add(f"{pattern.strip('*.')}-garbage-resealed", _resealed(file_op(pattern, garbage)),
            names=("step-00000002", pattern.strip("*")))
    # hostile pickles (manifest resealed): each would create the marker when unpickled
    for target in (".metadata", "rank-00000.pt"):
        for hname in ("reduce-system", "dotted-global", "nested", "builtins-eval"):
            add(f"hostile-{target.strip('.')}-{hname}", _hostile_pickle(target, hname),
                names=("step-00000002", target))
    add("missing-distcp", file_op("*.distcp", lambda p: p.unlink()), names=("step-00000002", ".distcp"))
    add("missing-rank-json", file_op("rank-00000.json", lambda p: p.unlink()), names=("step-00000002", "rank-00000"))
    add("rank-json-nan", file_op("rank-00000.json", lambda p: p.write_text('{"data": {"position": NaN}}')),
        names=("step-00000002", "rank-00000.json"))
    add("meta-future-version", file_op("meta.json", lambda p: p.write_text(
        json.dumps({**json.loads(p.read_text()), "format_version": 99}))), names=("step-00000002", "meta.json"))
    add("shape-change", None, names=("model.dim",), argv=train("train.steps=3", "train.save_every=1", "name=base",
                                                              "model.dim=32"))
    add("optimizer-change", None, names=("train.optimizer", "train.beta1"),
        argv=train("train.steps=3", "train.save_every=1", "name=base", "train.beta1=0.8"))
    add("layout-change", None, names=("step-00000002",),  # saved states are layout-free: the resume reshards
        argv=train("train.steps=3", "train.save_every=1", "name=base", "launch.nproc=2"), accept_ok=True,
        expect_out="resumed from step 2")
    add("steps-done", None, names=("train.steps", "step 2"), argv=train("train.steps=2", "name=base"))
    add("fresh-over-old", None, names=("resume", "runs/base", "step"),
        argv=train("train.steps=3", "name=base", "train.resume=false"))
    add("incomplete-newest", lambda w: (step2(w) / "COMPLETE").unlink(), names=("step-00000002",),
        accept_ok=True, expect_out="step-00000002")
    add("symlinked-step", lambda w: _replace_with_link(step2(w)), names=("step-00000002", "symlink", "link"),
        accept_ok=True, expect_out="resumed from step 2")  # a linked step is the user's layout: read, not written
    add("metrics-garbage", lambda w: (w / "runs" / "base" / "metrics.jsonl").write_bytes(b"\x00\xff{garbage"),
        names=("metrics.jsonl",), accept_ok=True)

    def metrics_link(w: Path) -> None:  # metrics.jsonl links to a file outside the run: it must not change
        outside = w.parent / "outside-metrics"
        outside.write_text("precious\n")
        (w / "runs" / "base" / "metrics.jsonl").unlink()
        (w / "runs" / "base" / "metrics.jsonl").symlink_to(outside)

    def outside_unchanged(case_dir: Path) -> str | None:
        outside = case_dir / "outside-metrics"
        ok = outside.is_file() and outside.read_text() == "precious\n"
        return None if ok else "wrote through the metrics.jsonl link to a file outside the run"

    out.append(Case("state-metrics-symlink", "state", resume, ("metrics.jsonl",), setup=metrics_link, timeout=120.0,
                    accept_ok=True, harm=outside_unchanged))
    add("next-step-is-file", lambda w: (w / "runs" / "base" / "step-00000003").write_text("x"),
        names=("step-00000003",), accept_ok=False)
    add("huge-step-number", lambda w: shutil.copytree(step2(w), w / "runs" / "base" / "step-99999999999"),
        names=("step-99999999999", "train.steps"))
    return out


def _replace_with_link(step: Path) -> None:
    outside = step.parents[3] / "outside-step"  # <root>/<id>/outside-step: a write there would be harmful
    shutil.move(str(step), str(outside))
    step.symlink_to(outside)


class _Reduce:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _hostile_pickle(target: str, kind: str) -> Callable[[Path], None]:
    def mutate(work: Path) -> None:
        marker = str(work.parent / "pwned")
        step = work / "runs" / "base" / "step-00000002"
        command = f"touch {marker}"
        if kind == "reduce-system":
            payload = pickle.dumps(_Reduce(os.system, (command,)), protocol=4)
        elif kind == "builtins-eval":
            payload = pickle.dumps(_Reduce(eval, (f"__import__('os').system({command!r})",)), protocol=4)
        elif kind == "nested":
            payload = pickle.dumps({"state": [1, (2, _Reduce(os.system, (command,)))]}, protocol=4)
        else:  # a dotted qualified name reached through an allowed module: torch -> os.system
            payload = (b"\x80\x04\x8c\x05torch\x94\x8c\x09os.system\x94\x93\x94\x8c" + bytes([len(command)])
                       + command.encode() + b"\x94\x85\x94R\x94.")
        if target == "rank-00000.pt":
            import io
            import zipfile

            buf = io.BytesIO()  # a torch zip archive whose data.pkl is the payload
            with zipfile.ZipFile(buf, "w") as z:
                z.writestr("archive/data.pkl", payload)
                z.writestr("archive/version", "3\n")
            payload = buf.getvalue()
        for path in sorted(step.glob(target)) or [step / target]:
            path.write_bytes(payload)
        _reseal(step)
    return mutate


def _reseal(step: Path) -> None:
    """Rewrite the COMPLETE manifest's sizes and CRC-32s to match the files as they are now."""
    import zlib

    marker = step / "COMPLETE"
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    for entry in manifest.get("files", []):
        path = step / entry["path"]
        if path.is_file():
            entry["size"], entry["crc32"] = path.stat().st_size, zlib.crc32(path.read_bytes())
    marker.write_text(json.dumps(manifest))


def _resealed(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    def both(work: Path) -> None:
        mutate(work)
        _reseal(work / "runs" / "base" / "step-00000002")
    return both


def all_cases() -> list[Case]:
    return (config_cases() + config_file_cases() + cli_cases() + data_cases() + runtime_cases() + launch_cases()
            + slurm_cases() + state_cases())


# ----------------------------------------------------------------------------------------- running
def _env(stub_dir: Path, stub_log: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    env["PATH"] = f"{stub_dir}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["STUB_LOG"] = str(stub_log)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _fmt(arg: str, work: Path, marker: Path) -> str:
    return arg.replace("{tiny}", TINY).replace("{dir}", str(work)).replace("{m}", str(marker))


def _format_payloads(argv: list[str], marker: Path) -> list[str]:
    return [a.replace("{m}", str(marker)) for a in argv]


def _stubs(root: Path) -> Path:
    stub_dir = root / "_stubs"
    stub_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sbatch", "srun", "scontrol", "sacct", "scancel", "squeue"):
        path = stub_dir / name
        path.write_text(STUB)
        path.chmod(0o755)
    return stub_dir


def _base_state(root: Path) -> Path:
    """A real run with complete steps 1 and 2 (save_every 1), copied into every state case."""
    base = root / "_base_state"
    if (base / "runs" / "base" / "step-00000002" / "COMPLETE").is_file():
        return base
    base.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "spartron.launch.cli", *[_fmt(a, base, base) for a in
            train("train.steps=2", "train.save_every=1", "name=base")]]
    proc = subprocess.run(argv, cwd=base, capture_output=True, text=True, timeout=300,
                          env=_env(_stubs(root), root / "_base.log"))
    if proc.returncode != 0:
        raise RuntimeError(f"the base run for the state cases failed:\n{proc.stderr[-3000:]}")
    return base


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith(INFO_PREFIXES)]


def classify(case: Case, rc: int | None, out: str, err: str, case_dir: Path, work: Path,
             stub_log: Path, before: set[str]) -> tuple[str, str]:
    pwned = [p for p in case_dir.rglob("pwned*")] + [p for p in work.glob("*touch*")]
    if pwned:
        return "harmful", f"payload ran: {pwned[0]}"
    outside = sorted(set(os.listdir(case_dir)) - before - {"work", "stdout", "stderr", "script.sh", "script.out"})
    if outside:
        return "harmful", f"wrote outside the work folder: {outside}"
    if case.harm is not None and (why := case.harm(case_dir)):
        return "harmful", why
    if case.forbid_submit and stub_log.is_file() and "sbatch" in stub_log.read_text():
        return "harmful", "submitted a job before refusing the input"
    if rc is None:
        return "hang", "timeout"
    text = out + err
    if case.fault:
        if rc != 0 and case.fault in err:
            return "clear", f"exit {rc}; report names {case.fault!r}"
        return ("silently accepted" if rc == 0 else "unclear"), f"exit {rc}; no {case.fault!r} in the report"
    if "Traceback (most recent call last)" in text:
        last = [line for line in text.splitlines() if line.strip()][-1][:200]
        return "traceback", last
    if rc == 0:
        if case.accept_ok and (case.expect_out is None or case.expect_out in text):
            return "accepted safely", "exit 0" + (f", output names {case.expect_out!r}" if case.expect_out else "")
        return "silently accepted", "exit 0"
    if case.expect_out is not None and case.expect_out in text:
        return "clear", f"exit {rc}; output says {case.expect_out!r}"
    lines = _error_lines(err)
    if len(lines) == 1 and lines[0].startswith("spartron: error:"):
        if not case.names or any(name in lines[0] for name in case.names):
            return "clear", lines[0][:300]
        return "unclear", f"does not name {case.names}: {lines[0][:250]}"
    return "unclear", f"exit {rc}, {len(lines)} lines: " + " | ".join(lines[-3:])[:300]


def run_case(case: Case, root: Path, stub_dir: Path, base_state: Path | None) -> Result:
    case_dir = root / case.id
    if case_dir.exists():
        shutil.rmtree(case_dir)
    work = case_dir / "work"
    if case.area == "state" and base_state is not None:
        shutil.copytree(base_state, work, symlinks=True)
    else:
        work.mkdir(parents=True)
    marker = case_dir / "pwned"
    argv = [_fmt(a, work, marker) for a in case.argv]
    shown = [a.replace("{tiny}", "configs/tiny.toml").replace("{m}", "<marker>").replace("{dir}", "<work>")
             for a in case.argv]
    shown = [f"{k}={v}" for k, v in case.env.items()] + shown
    if case.setup is not None:
        case.setup(work)
    before = set(os.listdir(case_dir))
    stub_log = case_dir / "stubs.log"
    before.add("stubs.log")
    env = {**_env(stub_dir, stub_log), **case.env}
    start = time.perf_counter()
    rc: int | None
    try:
        proc = subprocess.run([sys.executable, "-m", "spartron.launch.cli", *argv], cwd=work, env=env,
                              capture_output=True, timeout=case.timeout, start_new_session=True)
        rc, out, err = proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as exp:
        rc, out = None, (exp.stdout or b"").decode(errors="replace")
        err = (exp.stderr or b"").decode(errors="replace")
        _kill_leftovers(work)
    if case.run_script and rc == 0:
        script = case_dir / "script.sh"
        script.write_text(out)
        try:
            subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, timeout=30,
                           start_new_session=True)
        except subprocess.TimeoutExpired:
            rc = None
        bad_calls = [line for line in (stub_log.read_text().splitlines() if stub_log.is_file() else [])
                     if not line.startswith("srun ")]
        if bad_calls:
            return Result(case.id, case.area, "harmful", rc, time.perf_counter() - start,
                          f"script called {bad_calls[0][:120]}", shown)
    seconds = time.perf_counter() - start
    cls, detail = classify(case, rc, out, err, case_dir, work, stub_log, before)
    detail = detail.replace(str(case_dir), "<case>")  # the table does not depend on where it ran
    (case_dir / "stdout").write_text(out)
    (case_dir / "stderr").write_text(err)
    return Result(case.id, case.area, cls, rc, seconds, detail, shown)


def _kill_leftovers(work: Path) -> None:
    """Ranks of a timed-out case (their own session) are found by their cwd and killed."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/cwd").resolve() == work.resolve():
                os.kill(int(pid), 9)
        except (OSError, ValueError):
            pass


def run_audit(cases: list[Case], root: Path, jobs: int = 1, log=print) -> list[Result]:
    stub_dir = _stubs(root)
    base_state = _base_state(root) if any(c.area == "state" for c in cases) else None
    from concurrent.futures import ThreadPoolExecutor

    def one(case: Case) -> Result:
        result = run_case(case, root, stub_dir, base_state)
        log(f"{result.cls:<17} {result.seconds:5.1f}s {case.id}: {result.detail[:140]}")
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each case is its own subprocess and folder
        return list(pool.map(one, cases))


def write_results(results: list[Result], out_md: Path, out_json: Path, wall_s: float, jobs: int) -> None:
    counts = Counter(r.cls for r in results)
    by_area: dict[str, Counter] = {}
    for r in results:
        by_area.setdefault(r.area, Counter())[r.cls] += 1
    good = counts["clear"] + counts["accepted safely"]
    summary = {"cases": len(results), "counts": {c: counts[c] for c in CLASSES},
               "clear_or_safe_fraction": round(good / max(len(results), 1), 4),
               "by_area": {a: dict(c) for a, c in sorted(by_area.items())},
               "case_seconds": round(sum(r.seconds for r in results), 1), "wall_seconds": round(wall_s, 1),
               "jobs": jobs, "commit": _commit()}
    out_json.write_text(json.dumps({"summary": summary, "results": [r.__dict__ for r in results]}, indent=1) + "\n")
    lines = ["# Bad-input audit (`python benchmarks/audit.py`)", "",
             f"{len(results)} cases in {summary['wall_seconds']} s ({jobs} at a time) at commit {summary['commit']}. "
             f"Clear or accepted safely: {good} "
             f"({100 * good / max(len(results), 1):.1f}%).", "",
             "| class | cases |", "| --- | --- |"]
    lines += [f"| {c} | {counts[c]} |" for c in CLASSES]
    lines += ["", "| area | " + " | ".join(CLASSES) + " |", "| --- |" + " --- |" * len(CLASSES)]
    lines += [f"| {a} | " + " | ".join(str(c[k]) for k in CLASSES) + " |" for a, c in sorted(by_area.items())]
    lines += ["", "Inputs: `spartron` arguments (a state case also rewrites files of a saved step first, a data case",
              "writes the token file, a launch case sets the launcher's environment: see the case's code).", "",
              "| case | area | class | exit | input | what the user saw |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        shown = " ".join(r.argv).replace("|", "\\|").replace("\n", "\\n").replace("\r", "\\r").replace("`", "'")
        lines.append(f"| `{r.id}` | {r.area} | {r.cls} | {r.rc} | `{shown[:160]}` | {detail} |")
    out_md.write_text("\n".join(lines) + "\n")


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return proc.stdout.strip() + (" + uncommitted changes" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated areas or case-id prefixes")
    parser.add_argument("--quick", action="store_true", help="only the quick subset")
    parser.add_argument("--root", help="folder for the case folders (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="results stem (default benchmarks/results/audit for a full run)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    args = parser.parse_args()
    cases = all_cases()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.only:
        wanted = args.only.split(",")
        cases = [c for c in cases if c.area in wanted or any(c.id.startswith(w) for w in wanted)]
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="spartron-audit-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = run_audit(cases, root, jobs=args.jobs)
    wall = time.perf_counter() - start
    out = args.out or (None if (args.only or args.quick) else str(ROOT / "benchmarks" / "results" / "audit"))
    if out:
        write_results(results, Path(out + ".md"), Path(out + ".json"), wall, args.jobs)
        print(f"wrote {out}.md and {out}.json")
    counts = Counter(r.cls for r in results)
    print(", ".join(f"{c}: {counts[c]}" for c in CLASSES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
