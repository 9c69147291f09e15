"""benchmarks/convergence.py and benchmarks/dsa_stages.py: their CPU smoke modes (the Spartron side; torchtitan is
not installed here, which the report must say rather than claim a comparison), resuming a case in pieces, the
corpus reader, the noise-band arithmetic and the plateau rule."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import converge_corpus  # noqa: E402
import convergence  # noqa: E402
import dsa_stages  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def bench(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_convergence_smoke_resumes_in_pieces_and_says_torchtitan_did_not_run(tmp_path):
    pytest.importorskip("tokenizers")
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    done = bench("convergence.py", "--smoke", "--root", str(whole), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    first = bench("convergence.py", "--smoke", "--root", str(pieces), "--case", "spartron-bf16", "--steps-to", "2",
                  cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(convergence.read_metrics(pieces / "spartron-bf16" / "metrics.jsonl")) == [1, 2]
    rest = bench("convergence.py", "--smoke", "--root", str(pieces), "--case", "spartron-bf16", cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr[-3000:]
    report = json.loads((pieces / "convergence.json").read_text())
    uninterrupted = json.loads((whole / "convergence.json").read_text())
    case, ref = report["cases"]["spartron-bf16"], uninterrupted["cases"]["spartron-bf16"]
    assert case["status"] == "complete" and case["steps"] == [1, 2, 3, 4] and case["val_steps"] == [2, 4]
    assert case["loss"] == ref["loss"] and case["val_loss"] == ref["val_loss"]  # two pieces = one run, bitwise
    assert uninterrupted["cases"]["spartron-fp32"]["status"] == "complete"
    # the optimizer-held fp32 masters compute what FSDP2's do (CPU: the torch reference update, bitwise)
    held = uninterrupted["cases"]["spartron-fp32-optimizer"]
    assert held["status"] == "complete" and held["loss"] == uninterrupted["cases"]["spartron-fp32"]["loss"]
    corpus = uninterrupted["corpus"]
    assert corpus["documents"] == len(corpus["files"]) > 0
    assert corpus["text_bytes"] == sum(size for _, size in corpus["files"]) <= 1_000_000
    if uninterrupted["torchtitan_unavailable"]:  # this machine: no torchtitan, so nothing is compared
        assert all(uninterrupted["cases"][n]["status"] == "not run" for n in convergence.CASES if "titan" in n)
        assert uninterrupted["comparisons"]["bf16"] == {
            "status": "not compared: titan-bf16, titan-bf16-seed1 not run"}
        assert uninterrupted["comparisons"]["spartron-fp32-optimizer"] == {
            "status": "not compared: titan-fp32, titan-fp32-seed1 not run"}
    assert (whole / "convergence.png").stat().st_size > 0
    ran = {n for n, c in uninterrupted["cases"].items() if c["status"] != "not run"}
    assert set(uninterrupted["case_commits"]) == ran

    # --previous: the cases this root has not run come from an earlier report of the same corpus, with its commit
    earlier = json.loads(json.dumps(uninterrupted))
    earlier["commit"], earlier["case_commits"], earlier["case_devices"] = "e4r1ier", {}, {}
    earlier["cases"]["titan-bf16"] = {**ref, "side": "torchtitan", "data_seed": 0}
    earlier["cases"]["titan-bf16-seed1"] = {**ref, "side": "torchtitan", "data_seed": 1}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    joined = bench("convergence.py", "--smoke", "--root", str(pieces), "--report", "--previous",
                   str(tmp_path / "earlier.json"), "--out", str(tmp_path / "joined.json"), cwd=tmp_path)
    assert joined.returncode == 0, joined.stderr[-3000:]
    joined = json.loads((tmp_path / "joined.json").read_text())
    assert joined["cases"]["titan-bf16"]["loss"] == ref["loss"] and joined["case_commits"]["titan-bf16"] == "e4r1ier"
    assert joined["cases"]["spartron-fp32"]["loss"] == uninterrupted["cases"]["spartron-fp32"]["loss"]
    assert joined["case_commits"]["spartron-bf16"] == joined["commit"] != "e4r1ier"  # run under this root
    assert joined["comparisons"]["bf16"]["val_loss"]["diff_max"] == 0.0  # the same curve on both sides
    earlier["corpus"]["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(earlier))
    other = bench("convergence.py", "--smoke", "--root", str(pieces), "--report", "--previous",
                  str(tmp_path / "other.json"), "--out", str(tmp_path / "o.json"), cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith(
        f"spartron: error: --previous {tmp_path / 'other.json'} read another corpus (sha256 000000000000, ")


@pytest.mark.parametrize("name,why", [("list.json", "no cases, corpus sha256, commit or device"),
                                      ("nocorpus.json", "no cases, corpus sha256, commit or device"),
                                      ("nostatus.json", "a case without a status"),
                                      ("binary.json", "'utf-8' codec can't decode byte 0xff in position 0: "
                                                      "invalid start byte"),
                                      ("link.json", "not a regular file"), ("fifo.json", "not a regular file"),
                                      ("absent.json", "not a regular file")])
def test_a_previous_report_that_is_not_one_is_one_error_line(tmp_path, capsys, name, why):
    good = {"cases": {"spartron-bf16": {"status": "complete"}}, "corpus": {"sha256": "ab"}, "commit": "c",
            "device": "d"}
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert convergence.read_previous(tmp_path / "good.json") == good
    files = {"list.json": "[1, 2]", "nocorpus.json": json.dumps({**good, "corpus": []}),
             "nostatus.json": json.dumps({**good, "cases": {"spartron-bf16": {}}})}
    if name in files:
        (tmp_path / name).write_text(files[name])
    elif name == "binary.json":
        (tmp_path / name).write_bytes(b"\xff\xfe{")
    elif name == "link.json":
        (tmp_path / name).symlink_to(tmp_path / "good.json")
    elif name == "fifo.json":
        os.mkfifo(tmp_path / name)
    with pytest.raises(SystemExit) as stop:
        convergence.read_previous(tmp_path / name)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"spartron: error: --previous {tmp_path / name}: not a convergence report "
                                       f"({why})\n")


def test_a_torchtitan_case_without_torchtitan_is_one_error_line(tmp_path):
    if convergence.converge_titan.unavailable() is None:
        pytest.skip("torchtitan runs here")
    done = bench("convergence.py", "--smoke", "--root", str(tmp_path / "r"), "--case", "titan-bf16", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("spartron: error: case titan-bf16: torchtitan cannot run here: ")
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_dsa_stages_smoke(tmp_path):
    pytest.importorskip("tokenizers")
    root = tmp_path / "r"
    # dense-baseline before sparse: it starts from dense-hf and must not export warmup-hf (the sparse phase's,
    # which it raced when the two ran side by side)
    done = bench("dsa_stages.py", "--smoke", "--root", str(root), *[a for phase in ("dense", "warmup", "dense-baseline")
                                                                   for a in ("--phase", phase)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "dense-hf" / "config.json").is_file() and not (root / "warmup-hf").exists()
    done = bench("dsa_stages.py", "--smoke", "--root", str(root), "--phase", "sparse", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "warmup-hf" / "config.json").is_file()
    report = json.loads((tmp_path / "r" / "dsa_stages.json").read_text())
    assert report["device"] == "cpu" and report["torch"] == convergence.measured_on("x")["torch"]
    assert report["commit"] == convergence.measured_on(None)["commit"]  # this checkout's, as convergence.py's
    phases = report["phases"]
    assert phases["dense"]["steps"] == [1, 2, 3, 4]
    # smoke plateau rule (window 2, tolerance 1.0): plateaued at the 4th measurement, one more step saved
    assert report["warmup"]["plateau"]["step"] == 4 and phases["warmup"]["steps"] == [1, 2, 3, 4, 5]
    assert phases["warmup"]["metric_steps"] == [1, 2, 3, 4, 5]
    assert all(0.0 <= r <= 1.0 for r in phases["warmup"]["mean_recall"])
    assert report["warmup"]["backbone_equals_dense"]["identical"] is True
    # only the indexers train in the warm-up, with dense attention: the LM is the dense model's, bitwise
    assert set(phases["warmup"]["val_loss"]) == {phases["dense"]["val_loss"][-1]}
    assert phases["sparse"]["steps"] == phases["dense-baseline"]["steps"] == [1, 2, 3, 4]
    diff = report["sparse_vs_dense"]["val_diff"]
    assert diff == {str(s): a - b for s, a, b in zip(phases["sparse"]["val_steps"], phases["sparse"]["val_loss"],
                                                     phases["dense-baseline"]["val_loss"], strict=True)}


def test_dsa_phase_before_dense_is_one_error_line(tmp_path):
    pytest.importorskip("tokenizers")
    done = bench("dsa_stages.py", "--smoke", "--root", str(tmp_path / "r"), "--phase", "sparse", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("spartron: error: --phase sparse needs the dense phase trained "
                                                    "to its 4 steps first (--phase dense)")


def test_corpus_reads_docs_by_path_hash_and_records_them(tmp_path):
    docs = tmp_path / "doc"
    for pkg, name, data in [("a", "copyright", b"alpha"), ("b", "README", b"beta text"),
                            ("c", "changelog.Debian.gz", gzip.compress(b"gamma")), ("d", "copyright", b"\xff\xfe"),
                            ("e", "index.html", b"<p>not read</p>"), ("f", "NEWS", b"")]:
        (docs / pkg).mkdir(parents=True)
        (docs / pkg / name).write_bytes(data)
    (docs / "g").mkdir()
    (docs / "g" / "copyright").symlink_to(docs / "a" / "copyright")
    info = converge_corpus.build_corpus(docs, tmp_path / "out", max_bytes=1000)
    import hashlib

    expect = sorted(["a/copyright", "b/README", "c/changelog.Debian.gz"],
                    key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    assert [f for f, _ in info["files"]] == expect
    assert info["text_bytes"] == 5 + 9 + 5 and info["candidates"] == 5
    assert info["skipped"] == {"not_utf8_or_unreadable": 1, "empty": 1, "over_max_bytes": 0}
    texts = [json.loads(line)["text"] for line in (tmp_path / "out" / "corpus.jsonl").read_text().splitlines()]
    assert texts == [{"a/copyright": "alpha", "b/README": "beta text", "c/changelog.Debian.gz": "gamma"}[f]
                     for f in expect]
    capped = converge_corpus.build_corpus(docs, tmp_path / "capped", max_bytes=10)
    sizes = {"a/copyright": 5, "b/README": 9, "c/changelog.Debian.gz": 5}
    kept, total = [], 0
    for f in expect:
        if total + sizes[f] > 10:
            break
        kept.append(f)
        total += sizes[f]
    assert [f for f, _ in capped["files"]] == kept and capped["skipped"]["over_max_bytes"] > 0


def test_noise_band_and_windows():
    c = {"steps": [1, 2, 3, 4, 5], "loss": [5.0, 3.0, 2.0, 2.0, 9.0]}
    assert convergence.window_means(c, 2) == {2: 4.0, 4: 2.0}
    ours, ref = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}, {1: 1.0, 2: 2.5, 3: 3.1, 4: 3.8}
    other = {1: 0.0, 2: 0.0, 3: 3.5, 4: 4.4}
    b = convergence.band(ours, ref, other)
    assert b["points"] == [3, 4]
    assert b["diff"] == pytest.approx([-0.1, 0.2]) and b["noise"] == pytest.approx([-0.4, -0.6])
    assert b["diff_rms"] == pytest.approx((0.05 / 2) ** 0.5) and b["noise_rms"] == pytest.approx((0.52 / 2) ** 0.5)
    assert b["within_noise_band"] is True
    assert b["diff_max"] == pytest.approx(0.2) and b["noise_max"] == pytest.approx(0.6)
    assert convergence.band(ours, ref, {}) is None
    assert convergence.band({3: 3.0}, {3: 3.5}, {3: 3.4})["within_noise_band"] is False


def test_fp8_gap_is_the_mean_relative_difference_over_the_second_half():
    def case(losses, val):
        steps = list(range(1, len(losses) + 1))
        return {"status": "complete", "steps": steps, "loss": losses, "val_steps": [2, 4, 6, 8],
                "val_loss": val}

    bf16 = case([4.0] * 8, [4.0, 3.0, 2.0, 2.0])
    fp8 = case([4.0] * 4 + [4.004] * 4, [4.0, 3.0, 2.0, 2.012])
    gap = convergence.fp8_gap(fp8, bf16, width=2)
    assert gap["train_loss_windows"]["points"] == [6, 8]  # window ends 2, 4, 6, 8: the second half
    assert gap["train_loss_windows"]["mean_relative"] == pytest.approx(0.001)
    assert gap["train_loss_windows"]["within"] is True
    assert gap["val_loss"]["relative"] == pytest.approx([0.0, 0.006])
    assert gap["val_loss"]["mean_relative"] == pytest.approx(0.003)
    assert gap["val_loss"]["within"] is False  # 0.3%: above DeepSeek's 0.25%
    missing = convergence.fp8_gap({"status": "not run"}, bf16, width=2)
    assert missing == {"status": "not compared: spartron-fp8 not run"}
    assert gap["against"] == "spartron-bf16"
    assert convergence.fp8_gap(fp8, {"status": "not run"}, 2, "spartron-fp32") == {
        "status": "not compared: spartron-fp32 not run"}


def test_recompare_makes_a_reports_comparisons_again_from_its_cases(tmp_path):
    """--recompare: a report recorded before a comparison existed (FP8 against the fp32-master curve) gets it from
    its own cases; the cases, commits and devices stay the report's; a file that is not a report, or other
    modes beside it, is one error line."""
    def case(precision, loss, val):
        return {"side": "spartron", "precision": precision, "status": "complete", "steps": [1, 2, 3, 4],
                "loss": loss, "val_steps": [2, 4], "val_loss": val}

    old = {"benchmark": "convergence", "commit": "0ld", "device": "H100", "corpus": {"sha256": "ab"}, "eval_every": 2,
           "case_commits": {"spartron-fp8": "0ld"}, "comparisons": {"fp8": {"stale": True}},
           "cases": {"spartron-bf16": case("bf16", [4.0] * 4, [3.0, 2.0]),
                     "spartron-fp32": case("fp32", [4.0, 4.0, 2.0, 2.0], [3.0, 2.0]),
                     "spartron-fp8": case("fp8", [4.0, 4.0, 2.002, 2.002], [3.0, 2.01])}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    done = bench("convergence.py", "--recompare", str(tmp_path / "old.json"), "--out", str(tmp_path / "new.json"),
                 "--commit", "n3w", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    new = json.loads((tmp_path / "new.json").read_text())
    assert new["recompared"] == {"from": "old.json", "commit": "n3w"}
    assert (new["commit"], new["device"], new["case_commits"]) == ("0ld", "H100", {"spartron-fp8": "0ld"})
    assert new["cases"]["spartron-fp8"] == old["cases"]["spartron-fp8"]
    assert new["cases"]["titan-bf16"] == {"side": "torchtitan", "precision": "bf16", "status": "not run"}
    vs_fp32 = new["comparisons"]["fp8_vs_fp32"]
    assert vs_fp32["against"] == "spartron-fp32" and vs_fp32["train_loss_windows"]["relative"] == pytest.approx([0.001])
    assert vs_fp32["val_loss"]["relative"] == pytest.approx([0.005]) and vs_fp32["val_loss"]["within"] is False
    assert new["comparisons"]["fp8"]["against"] == "spartron-bf16"
    assert new["comparisons"]["bf16"] == {"status": "not compared: titan-bf16, titan-bf16-seed1 not run"}
    assert new["comparisons"]["spartron-fp8-edges-bf16_vs_fp32"] == {
        "status": "not compared: spartron-fp8-edges-bf16 not run"}
    assert (tmp_path / "new.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text("[1]")
    bad = bench("convergence.py", "--recompare", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x.json"),
                cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        f"spartron: error: --recompare {tmp_path / 'bad.json'}: not a convergence report (no cases, corpus sha256, "
        "commit or device)")
    both = bench("convergence.py", "--recompare", str(tmp_path / "old.json"), "--report", cwd=tmp_path)
    assert both.returncode == 2 and "--recompare reads a report alone" in both.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_fp8_variants_are_the_fp8_case_with_megatrons_knobs():
    """spartron-fp8-wgrad-bf16 / -edges-bf16: the FP8 case's config (fp32 masters, the Triton backend) with the bf16
    weight gradients / the first and last decoder layers in bf16, and nothing else changed."""
    from spartron.runtime.config import load_config

    base = load_config(ROOT / "configs" / "converge-dsv3.toml", convergence.PRECISION["fp8"])
    for name, fields in (("spartron-fp8-wgrad-bf16", {"wgrad": "model_dtype"}),
                         ("spartron-fp8-edges-bf16", {"layers_at_start_in_bf16": 1, "layers_at_end_in_bf16": 1})):
        assert convergence.CASES[name] == ("spartron", "fp8", 0)
        cfg = load_config(ROOT / "configs" / "converge-dsv3.toml",
                          [*convergence.PRECISION["fp8"], *convergence.FP8_VARIANTS[name]])
        assert cfg.model.fp8 == base.model.fp8.model_copy(update=fields) and cfg.model.master_dtype == "float32"
        assert cfg.model.model_copy(update={"fp8": base.model.fp8}) == base.model
        assert cfg.model_copy(update={"model": base.model}) == base


def test_plateau_rule():
    assert dsa_stages.plateau([0.1, 0.2, 0.3], 2, 0.01) is False  # fewer than two windows
    assert dsa_stages.plateau([0.1, 0.2, 0.30, 0.31], 2, 0.01) is False  # gained 0.155
    assert dsa_stages.plateau([0.50, 0.52, 0.515, 0.52], 2, 0.01) is True  # gained 0.0025
    assert dsa_stages.mean_recall({"indexer_recall_per_layer": [0.5, 0.7]}) == pytest.approx(0.6)
    assert dsa_stages.mean_recall({}) is None


def test_recall_history_follows_the_run_being_trained():
    def rec(step, recall=None):
        return {"step": step, **({"indexer_recall_per_layer": [recall]} if recall is not None else {})}

    earlier = {s: rec(s, 0.5 + s / 100) for s in (10, 20, 30, 40, 50)} | {55: rec(55)}
    history = dsa_stages.RecallHistory(earlier)
    assert history.values() == pytest.approx([0.6, 0.7, 0.8, 0.9, 1.0])
    assert history.add(rec(31)) is False  # resumed from step 30: steps 40 and 50 are re-trained
    assert history.values() == pytest.approx([0.6, 0.7, 0.8])
    assert history.add(rec(40, 0.2)) is True
    assert history.values() == pytest.approx([0.6, 0.7, 0.8, 0.2])
    assert history.add(rec(10, 0.3)) is True  # no complete save: a fresh run replaces all of it
    assert history.values() == pytest.approx([0.3])
    # the restarted warm-up of the first GPU run: its lower recalls after the earlier run's higher ones read
    # as "no gain" to the plateau rule; with the history replaced it has too few measurements to decide
    old = dsa_stages.RecallHistory({s: rec(s, 0.93) for s in range(10, 80, 10)})
    for s, r in ((10, 0.906), (20, 0.920), (30, 0.928)):
        old.add(rec(s, r))
    assert dsa_stages.plateau(old.values(), 5, 0.005) is False
    mixed = [0.93] * 7 + [0.906, 0.920, 0.928]
    assert dsa_stages.plateau(mixed, 5, 0.005) is True


@pytest.mark.slow
def test_a_sigterm_mid_case_saves_the_step_it_was_on(tmp_path):
    """A call's time limit ends a case with SIGTERM: the step it was on is saved, as under `spartron train`
    (the handler was constructed but never installed, so a killed warm-up restarted from step 0 on the GPU)."""
    pytest.importorskip("tokenizers")
    import signal
    import time

    root = tmp_path / "r"
    args = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--smoke", "--root", str(root), "--case",
            "spartron-bf16", "--set", "train.steps=100000", "--set", "train.eval_every=0"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = root / "spartron-bf16" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while len(convergence.read_metrics(metrics)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    saved = sorted(p.name for p in (root / "spartron-bf16").glob("step-*"))
    assert len(saved) == 1, (saved, out[-2000:])
    step = int(saved[0].split("-")[1])
    assert step >= 3 and f"SIGTERM: saved step {step} of 100000" in out + err
    assert max(convergence.read_metrics(metrics)) == step
