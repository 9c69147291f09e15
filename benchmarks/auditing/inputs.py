"""The first audit's config, config-file, CLI and pre-spawn cases (kept as they were)."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.auditing.core import TINY, Case, plan, train, tstr, write


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
        ("gc_every-neg", "train.gc_every=-1", "train.gc_every"),
        ("gc_every-str", 'train.gc_every="often"', "train.gc_every"),
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
        ("compile-ac", ["train.compile=true", "ac.reentrant=true"], "train.compile"),
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
        ("dsa-kl-chunk-negative", ["model.dsa.kl_dense_chunk=-1"], "model.dsa.kl_dense_chunk"),
        ("dsa-kl-chunk-float", ["model.dsa.kl_dense_chunk=2.5"], "model.dsa.kl_dense_chunk"),
        ("dsa-attn-chunk-negative", ["model.dsa.attention_chunk=-8"], "model.dsa.attention_chunk"),
        ("dsa-attn-chunk-string", ["model.dsa.attention_chunk='all'"], "model.dsa.attention_chunk"),
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
    # ac.reentrant left unset resolves to false under train.compile (documented): accepting is right
    cases.append(Case("config-compile-ac-unset", "config", plan("train.compile=true"), accept_ok=True,
                      note="an unset ac.reentrant is false under train.compile (compiled regions are non-reentrant)"))
    # override syntax
    for cid, item, key in [("no-equals", "nonsense", "nonsense"), ("empty-key", "=1", "=1"),
                           ("empty-part", "a..b=1", "a..b"), ("value-not-section", "train.steps.x=1", "train.steps"),
                           ("deep-value", "train.lr=" + "[" * 5000, "train.lr"),
                           ("replace-table", "train={steps = 1}", "train"),
                           ("replace-dsa", "model.dsa={}", "model.dsa")]:
        add(f"override-{cid}", [item], [key])
    return cases


def config_file_cases() -> list[Case]:
    base = Path(TINY).read_bytes()
    out = []

    def add(cid, data: bytes | None, names=("bad.toml",), path="bad.toml", quick=False):
        names = (*names, "bad.toml")
        out.append(Case(f"file-{cid}", "config", ["plan", path], names,
                        setup=write(Path(path), data) if data is not None else None, quick=quick))

    add("binary", bytes(range(256)) * 4, quick=True)
    out.append(Case("file-bom", "config", ["plan", "bom.toml"], accept_ok=True,
                    setup=write(Path("bom.toml"), b"\xef\xbb\xbf" + base)))
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
        setup=write(Path("g.jsonl"), b"{not json\n\x00\xff"))
    add("regress-empty", ["regress", "compare", "e.jsonl", "e.jsonl"], ["e.jsonl"], setup=write(Path("e.jsonl"), b""),
        expect_out="[FAIL] steps: the baseline has no step records")
    add("regress-wrong-records", ["regress", "compare", "w.jsonl", "w.jsonl"], ["w.jsonl"],
        setup=write(Path("w.jsonl"), b'{"type": "step", "step": "x"}\n[1, 2]\n'))
    add("regress-loss-rel-neg", ["regress", "compare", "nope", "nope", "--loss-rel", "-1"], ["--loss-rel", "nope"])
    add("regress-loss-rel-nan", ["regress", "compare", "m.jsonl", "m.jsonl", "--loss-rel", "nan"], ["--loss-rel"],
        setup=write(Path("m.jsonl"), b""))
    add("regress-repeats-0", ["regress", "run", "{tiny}", "--repeats", "0"], ["--repeats"])
    add("regress-repeats-1", ["regress", "run", "{tiny}"], ["--repeats", "--baseline"])
    add("smoke-bad-config", ["smoke", "{tiny}", "--set", "train.lr=inf"], ["train.lr"])
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
            case.setup = write(Path("afile"), b"x")
    return out
