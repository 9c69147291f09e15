"""Hugging Face export (`convert --from RUN --to-hf DIR`) of a real tiny-hf run -- hostile output folders, saved
steps that are corrupt or hold NaN, a full disk and signals mid-export -- and the `convert` command's own flags."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.auditing.core import Case, decoy, new_entry, train
from benchmarks.auditing.state import _reseal

RUN = "runs/hfbase"
STEP = f"{RUN}/step-00000002"


def export(out: str = "out", src: str = RUN, *extra: str) -> list[str]:
    return ["convert", "--from", src, "--to-hf", out, *extra]


def _normal_files(case_dir: Path) -> str | None:
    """An export someone else can read like any other file the user writes (umask), and nothing partial."""
    out = case_dir / "work" / "out"
    if not (out / "config.json").is_file():
        return None
    for path in out.iterdir():
        mode = path.stat().st_mode & 0o777
        if mode & 0o044 == 0:
            return f"{path.name} written with mode {oct(mode)}, unreadable to the group and others"
    leftovers = [p.name for p in case_dir.joinpath("work").iterdir() if p.name.startswith(".") or "tmp" in p.name]
    return f"left {leftovers} next to the export" if leftovers else None


def _nothing_partial(case_dir: Path) -> str | None:
    """A refused export leaves no half-written folder that would block the retry."""
    out = case_dir / "work" / "out"
    if out.exists() and not out.is_symlink() and out.is_dir() and any(out.iterdir()) \
            and not (out / "model.safetensors.index.json").is_file():
        return f"left a partial export: {sorted(p.name for p in out.iterdir())[:4]}"
    stray = [p.name for p in (case_dir / "work").iterdir() if p.name.startswith(".") or "tmp" in p.name.lower()]
    return f"left {stray} in the working folder" if stray else None


def poison_state(step_rel: str, key: str, value: float) -> Callable[[Path], None]:
    """One tensor of a saved step set to `value` (rewritten through torch's own DCP tools, manifest resealed)."""
    def setup(work: Path) -> None:
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

        step = work / step_rel
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(step), f"{tmp}/s.pt")
            state = torch.load(f"{tmp}/s.pt", weights_only=True)
            state["model"][key].view(-1)[0] = value
            torch.save(state, f"{tmp}/s.pt")
            torch_save_to_dcp(f"{tmp}/s.pt", f"{tmp}/dcp")
            for path in step.glob("*.distcp"):
                path.unlink()
            for path in Path(f"{tmp}/dcp").iterdir():
                shutil.copy(path, step / path.name)
        _reseal(step)
    return setup


def _new_entry(work: Path) -> bool:
    return any(p.name not in ("runs",) for p in work.iterdir())


def _packed_run(work: Path) -> None:
    """A tiny-hf run trained on a `spartron data` folder: its export should carry the tokenizer."""
    import subprocess
    import sys

    from benchmarks.auditing.core import TINY_HF

    argv = train("train.steps=1", "train.save_every=1", "name=packed", "train.data.kind=packed",
                 'train.data.path="tok"', preset="{tinyhf}")
    argv = [a.replace("{tinyhf}", TINY_HF) for a in argv]
    subprocess.run([sys.executable, "-m", "spartron.launch.cli", *argv], cwd=work, capture_output=True, timeout=300)


def _tokenizer_exported(case_dir: Path) -> str | None:
    out = case_dir / "work" / "out"
    if (out / "config.json").is_file() and not (out / "tokenizer.json").is_file():
        return "the run was trained on tokenized data but the export has no tokenizer.json (AutoTokenizer fails)"
    return None


def _fp8_export(case_dir: Path) -> str | None:
    """An FP8 export holds E4M3 weights with their scales and imports back (the headers checked, a model loaded)."""
    problem = _normal_files(case_dir)
    out = case_dir / "work" / "out"
    if problem is not None or not (out / "config.json").is_file():
        return problem
    from spartron.interop.hf import import_hf
    from spartron.layers.model import build_model

    if "quantization_config" not in json.loads((out / "config.json").read_text()):
        return "an --fp8-weights export without quantization_config in config.json"
    weights = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    if not any(name.endswith("_scale_inv") for name in weights):
        return "an --fp8-weights export without any weight_scale_inv"
    try:
        cfg, load = import_hf(out)
        load(build_model(cfg))
    except Exception as err:  # noqa: BLE001 - any failure to read it back is the finding
        return f"the FP8 export does not import back: {type(err).__name__}: {err}"[:200]
    return None


def export_cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, argv, names, category, setup=None, harm=_nothing_partial, **kw):
        out.append(Case(f"hf-export-{cid}", "hf-export", argv, tuple(names), category=category, setup=setup,
                        base=kw.pop("base", ("hfrun",)), timeout=kw.pop("timeout", 90.0), harm=harm, **kw))

    add("plain", export(), (), "values", harm=_normal_files, accept_ok=True, quick=True)
    add("out-empty-dir", export(), ["out"], "paths", setup=lambda w: (w / "out").mkdir(), harm=_normal_files,
        accept_ok=True, note="issue 34: an existing empty folder is accepted")
    add("out-not-empty", export(), ["out"], "paths", setup=lambda w: ((w / "out").mkdir(),
                                                                       (w / "out" / "mine.txt").write_text("x")),
        harm=None)
    add("out-link-empty-dir", export(), ["out"], "paths", setup=lambda w: (w / "out").symlink_to(decoy(w) / "empty"))
    add("out-link-dir", export(), ["out"], "paths", setup=lambda w: (w / "out").symlink_to(decoy(w) / "notes"))
    add("out-link-dangling", export(), ["out"], "paths",
        setup=lambda w: (w / "out").symlink_to(decoy(w) / "new-folder"))
    add("out-link-file", export(), ["out"], "paths",
        setup=lambda w: (w / "out").symlink_to(decoy(w) / "precious.txt"))
    add("out-is-file", export(), ["out"], "paths", setup=lambda w: (w / "out").write_text("mine"), harm=None)
    add("out-under-file", export("out/x"), ["out"], "paths", setup=lambda w: (w / "out").write_text("mine"),
        harm=None)
    add("out-fifo", export(), ["out"], "paths", setup=lambda w: os.mkfifo(w / "out"), harm=None, timeout=60.0)
    add("out-parents-missing", export("a/b/out"), ["a/b"], "paths", harm=None, accept_ok=True,
        note="the missing parents are made (as mkdir -p); a parent that is a file or a link loop is one line")
    add("out-too-long", export("o" * 5000), ["ooo"], "sizes", harm=None)
    add("out-cwd", export("."), ["'.'", "exists", "empty"], "paths", harm=None)
    add("out-is-run-dir", export(RUN), [RUN, "hfbase"], "paths", harm=None)
    add("out-inside-step", export(f"{STEP}/hf"), ["step-00000002"], "paths", harm=None)
    add("out-inside-run", export(f"{RUN}/hf"), [RUN, "hfbase"], "paths", harm=None, accept_ok=True,
        note="a new folder beside the steps is the user's choice; the run's steps stay intact")
    add("from-missing", export("out", "nope"), ["nope"], "paths")
    add("from-file", export("out", "f"), ["'f'", "f:"], "paths", setup=lambda w: (w / "f").write_text("x"))
    add("from-empty-dir", export("out", "e"), ["'e'", "e:"], "paths", setup=lambda w: (w / "e").mkdir())
    add("from-incomplete-step", export("out", STEP), ["step-00000002", "COMPLETE"], "partial",
        setup=lambda w: (w / STEP / "COMPLETE").unlink())
    add("from-run-newest-incomplete", export(), (), "partial", setup=lambda w: (w / STEP / "COMPLETE").unlink(),
        accept_ok=True, harm=_normal_files, note="the run's newest complete step (1) is exported")
    add("from-step-link-outside", export("out", "linked"), (), "paths", accept_ok=True, harm=_normal_files,
        setup=lambda w: (shutil.move(str(w / STEP), str(decoy(w) / "step")), (w / "linked").symlink_to(
            decoy(w) / "step")), note="reading a linked step is the user's layout; it stays unchanged (hashed)")

    def garbage(pattern: str) -> Callable[[Path], None]:
        def setup(work: Path) -> None:
            for path in (work / STEP).glob(pattern):
                path.write_bytes(os.urandom(path.stat().st_size))
            _reseal(work / STEP)
        return setup

    add("from-distcp-garbage", export("out", STEP), ["step-00000002", ".distcp"], "corrupt", setup=garbage("*.distcp"))
    add("from-metadata-garbage", export("out", STEP), ["step-00000002", ".metadata"], "corrupt",
        setup=garbage(".metadata"))
    add("from-meta-garbage", export("out", STEP), ["step-00000002", "meta.json"], "corrupt", setup=garbage("meta.json"))
    add("from-distcp-truncated", export("out", STEP), ["step-00000002", ".distcp"], "corrupt",
        setup=lambda w: [p.write_bytes(p.read_bytes()[:1000]) for p in (w / STEP).glob("*.distcp")])
    for key, cid in (("embed.weight", "embed"), ("norm.weight", "norm"),
                     ("layers.1.ffn.router.weight", "router")):
        for value, vname in ((float("nan"), "nan"), (float("inf"), "inf")):
            add(f"from-{vname}-{cid}", export("out", STEP), ["non-finite", "NaN", "nan", "Inf", "inf"], "nonfinite",
                setup=poison_state(STEP, key, value), timeout=120.0)
    add("from-tiny-dsa", export("out", "runs/base"), ["model.dsa"], "values", base=("state",))
    for value, names, accept in (("0", ["--max-shard-bytes"], False), ("-1", ["--max-shard-bytes"], False),
                                 ("nan", ["--max-shard-bytes"], False), ("x", ["--max-shard-bytes"], False),
                                 ("1", (), True), (str(10**30), (), True), ("1e9", ["--max-shard-bytes"], False)):
        add(f"max-shard-bytes-{value[:8]}", export("out", RUN, "--max-shard-bytes", value), names,
            "sizes" if value not in ("nan", "x") else "values", accept_ok=accept,
            harm=_normal_files if accept else _nothing_partial)
    # a full disk mid-export (RLIMIT_FSIZE), then a retry that must succeed
    add("disk-full-then-retry", export(), ["out", "safetensors"], "partial", fsize=400_000, retry=export(),
        accept_ok=True, harm=_normal_files)
    add("disk-full-tiny-then-retry", export(), ["out", "config.json"], "partial", fsize=500, retry=export(),
        accept_ok=True, harm=_normal_files)
    for signame in ("SIGTERM", "SIGINT", "SIGKILL"):
        add(f"{signame.lower()}-then-retry", export(), (), "signals",
            interrupt=(getattr(signal, signame), _new_entry), retry=export(), accept_ok=True, harm=_normal_files)
    add("fp8-weights", export("out", RUN, "--fp8-weights"), (), "values", accept_ok=True, harm=_fp8_export,
        note="DeepSeek's release format: E4M3 layer weights with 128 x 128 scale_inv blocks, imported back")
    add("fp8-weights-nan-router", export("out", STEP, "--fp8-weights"), ["non-finite", "NaN", "nan"], "nonfinite",
        setup=poison_state(STEP, "layers.1.ffn.router.weight", float("nan")), timeout=120.0)
    add("fp8-weights-inf-expert", export("out", STEP, "--fp8-weights"), ["non-finite", "Inf", "inf"], "nonfinite",
        setup=poison_state(STEP, "layers.1.ffn.experts.w1", float("inf")), timeout=120.0,
        note="an Inf weight would quantise to a NaN scale: refused before any is written")
    add("fp8-weights-disk-full-then-retry", export("out", RUN, "--fp8-weights"), ["out", "safetensors"], "partial",
        fsize=200_000, retry=export("out", RUN, "--fp8-weights"), accept_ok=True, harm=_fp8_export)
    add("tokenizer-included", export("out", "runs/packed"), (), "values", base=("tok",), setup=_packed_run,
        accept_ok=True, harm=_tokenizer_exported, timeout=120.0,
        note="issue 34: an export of a run trained on tokenized data includes its tokenizer")
    return out


def convert_cases() -> list[Case]:
    """The `convert` command's flags, and --from-hf's output folder, a full disk and signals."""
    out: list[Case] = []
    imp = ["convert", "--from-hf", "hf", "--to", "out", "--config", "{tinyhf}"]

    def add(cid, argv, names, category="values", setup=None, **kw):
        out.append(Case(f"convert-{cid}", "convert", argv, tuple(names), category=category, setup=setup,
                        base=kw.pop("base", ("hf", "hfrun")), timeout=kw.pop("timeout", 90.0), **kw))

    add("no-flags", ["convert"], ["--from-hf", "--from"], quick=True)
    add("from-hf-no-to", ["convert", "--from-hf", "hf"], ["--to"])
    add("to-no-from", ["convert", "--to", "out"], ["--from-hf", "--from"])
    add("both-sources", ["convert", "--from-hf", "hf", "--from", RUN, "--to", "out"], ["--from-hf", "--from"])
    add("both-targets", ["convert", "--from", RUN, "--to-hf", "o1", "--to", "o2"], ["--to-hf", "--to"])
    add("from-with-to", ["convert", "--from", RUN, "--to", "out"], ["--to", "--to-hf"])
    add("from-hf-with-to-hf", ["convert", "--from-hf", "hf", "--to-hf", "out"], ["--to-hf", "--to"])
    add("shard-bytes-on-import", [*imp, "--max-shard-bytes", "100"], ["--max-shard-bytes"], harmless=True)
    add("fp8-weights-on-import", [*imp, "--fp8-weights"], ["--fp8-weights"], harmless=True)
    add("config-on-export", [*export(), "--config", "{tinyhf}"], ["--config"], harmless=True)
    add("set-on-export", [*export(), "--set", "train.lr=1.0"], ["--set", "train.lr"], harmless=True)
    add("config-missing", ["convert", "--from-hf", "hf", "--to", "out", "--config", "nope.toml"], ["nope.toml"],
        category="paths")
    add("config-garbage", ["convert", "--from-hf", "hf", "--to", "out", "--config", "g.toml"], ["g.toml"],
        category="corrupt", setup=lambda w: (w / "g.toml").write_bytes(b"\x00\xff[[["))
    add("set-unknown", [*imp, "--set", "train.bogus=1"], ["train.bogus"])
    add("set-nan-lr", [*imp, "--set", "train.lr=nan"], ["train.lr"], category="nonfinite")
    add("set-model-differs", [*imp, "--set", "model.dim=32"], ["model.dim"])
    add("config-dsa-model", ["convert", "--from-hf", "hf", "--to", "out", "--config", "{tiny}"],
        ["model.dsa", "model", "[model]"], harmless=True, accept_ok=True, expect_out="spartron: note: model.dsa = ",
        note="config.json decides the model: each [model] key of the config it replaces is a `spartron: note:` line")
    add("to-empty-dir", imp, ["out"], category="paths", setup=lambda w: (w / "out").mkdir(), accept_ok=True)
    add("to-not-empty", imp, ["out"], category="paths",
        setup=lambda w: ((w / "out").mkdir(), (w / "out" / "mine.txt").write_text("x")))
    add("to-existing-run", ["convert", "--from-hf", "hf", "--to", RUN, "--config", "{tinyhf}"], [RUN, "hfbase"],
        category="paths")
    add("to-link-scratch", imp, ["out"], category="paths", accept_ok=True, skip_hash=("scratch",),
        setup=lambda w: ((w.parent / "scratch").mkdir(), (w / "out").symlink_to(w.parent / "scratch")),
        note="as for train (rundir-run-link-new-folder): a run directory that is a link to an empty folder is "
             "the user's layout; the import fills that folder")
    add("to-link-dangling", imp, ["out"], category="paths", setup=lambda w: (w / "out").symlink_to(decoy(w) / "x"))
    add("to-file", imp, ["out"], category="paths", setup=lambda w: (w / "out").write_text("mine"))
    add("to-fifo", imp, ["out"], category="paths", setup=lambda w: os.mkfifo(w / "out"), timeout=60.0)
    add("to-too-long", ["convert", "--from-hf", "hf", "--to", "o" * 5000, "--config", "{tinyhf}"], ["ooo"],
        category="sizes")
    add("disk-full-then-retry", imp, ["out", "step-00000000"], category="partial", fsize=300_000, retry=imp,
        accept_ok=True)
    for signame in ("SIGTERM", "SIGKILL"):
        add(f"{signame.lower()}-then-retry", imp, (), category="signals",
            interrupt=(getattr(signal, signame), new_entry("hf", "runs")), retry=imp, accept_ok=True)

    def resumed_like_init(case_dir: Path) -> str | None:
        """The converted step-0 run's first loss equals a train.init_from run's (issue 34, item 3)."""
        work = case_dir / "work"
        try:
            a = _first_record(work / "out" / "metrics.jsonl")
            b = _first_record(work / "runs" / "init" / "metrics.jsonl")
        except (OSError, ValueError, StopIteration):
            return None  # a run that did not train is classified by its exit status and error
        if a is None or b is None or abs(a - b) > 1e-5:
            return f"step-1 loss {a} after convert --from-hf vs {b} with train.init_from"
        return None

    def init_run(work: Path) -> None:
        import subprocess
        import sys

        from benchmarks.auditing.core import TINY_HF

        for argv in (train('train.init_from="hf:hf"', "name=init", "model.mtp.depth=0", preset="{tinyhf}"),
                     ["convert", "--from-hf", "hf", "--to", "out", "--config", "{tinyhf}"]):
            argv = [a.replace("{tinyhf}", TINY_HF) for a in argv]
            subprocess.run([sys.executable, "-m", "spartron.launch.cli", *argv], cwd=work, capture_output=True,
                           timeout=300)
        (work / "model.toml").write_text((work / "out" / "model.toml").read_text())

    resume = train('train.run_dir="out"', "train.resume=true", "name=conv", "model.mtp.depth=0", preset="{tinyhf}")
    add("trains-like-init-from", resume, (), setup=init_run, accept_ok=True, harm=resumed_like_init, timeout=180.0,
        note="issue 34 item 3: a run started from the converted step 0 trains like train.init_from")
    return out


def _first_record(path: Path) -> float | None:
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "step":
            return float(record["loss"])
    return None


def cases() -> list[Case]:
    return export_cases() + convert_cases()
