"""benchmarks/results/: one folder per benchmark, every JSON names its commit in `commit`, and the checked-in
index (LATEST.json, README.md there, docs/RESULTS.md) is what benchmarks/results_index.py generates."""

import json
from pathlib import Path

import pytest

from benchmarks import results_index

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _all_keys(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _all_keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _all_keys(v)


def test_checked_in_index_equals_what_the_script_generates():
    for rel, text in results_index.generate().items():
        assert (ROOT / rel).read_text() == text, f"{rel} is stale: run python benchmarks/results_index.py"
    assert results_index.main(["--check"]) == 0


def test_every_result_json_names_its_commit_in_one_field():
    files = [p for p in RESULTS.rglob("*.json") if p.parent != RESULTS]  # top level: LATEST.json, audit.json
    assert len(files) > 100
    for p in files:
        d = json.loads(p.read_text())
        assert "commit" in d, p
        assert d["commit"] is None and d.get("commit_note") or isinstance(d["commit"], str) and d["commit"], p
        assert not {"git_commit", "commit_inferred"} & set(_all_keys(d)), p


def test_one_folder_per_benchmark_named_after_its_script():
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()} - {"archive"}
    archived = {p.name for p in (RESULTS / "archive").iterdir()}
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert folders - scripts == set(results_index.NON_SCRIPT_FOLDERS)
    assert archived <= folders | scripts
    assert {p.name for p in RESULTS.iterdir() if p.is_file()} <= results_index.TOP_LEVEL


def test_the_index_names_the_current_file_device_commit_and_headline():
    rows = json.loads((RESULTS / "LATEST.json").read_text())["results"]
    row = next(r for r in rows if r["file"] == "benchmarks/results/e2e/e2e_dsv3-12l_compile_ae69b3a.json")
    assert row == {"benchmark": "e2e", "file": "benchmarks/results/e2e/e2e_dsv3-12l_compile_ae69b3a.json",
                   "device": "NVIDIA H200", "commit": "ae69b3a6d7aa8f7b05655aabb499d465207a04ce",
                   "headline": "none+compile 211.7 ms; selective+compile 220.0 ms; full+compile 254.5 ms",
                   "beside": ["e2e_dsv3-12l_compile_ae69b3a.log"]}
    assert not [r for r in rows if "/archive/" in r["file"]]
    assert "| e2e | [e2e/e2e_dsv3-12l_compile_ae69b3a.json]" in (RESULTS / "README.md").read_text()
    assert ("- `e2e_dsv3-12l_compile_ae69b3a.json` (NVIDIA H200, ae69b3a): none+compile 211.7 ms; "
            "selective+compile 220.0 ms; full+compile 254.5 ms") in (ROOT / "docs" / "RESULTS.md").read_text()


def _tree(tmp_path: Path) -> Path:
    e2e = tmp_path / "benchmarks" / "results" / "e2e"
    e2e.mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    run = {"benchmark": "e2e", "device": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
           "results": [{"mode": "none", "step_time_s": 0.25}, {"mode": "full", "step_time_s": 0.3125}]}
    (e2e / "e2e_x_abc1234.json").write_text(json.dumps(run))
    (e2e / "e2e_x_abc1234.log").write_text("step 1\n")
    (e2e / "e2e_x_abc1234_extra.png").write_bytes(b"png")
    (e2e / "pytest_def5678.log").write_text("== 3 passed, 1 skipped in 2.00s ==\n")
    (tmp_path / "benchmarks" / "results" / "archive" / "e2e").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "archive" / "e2e" / "old.json").write_text("{}")
    return tmp_path


def test_entries_pair_logs_with_their_json_and_read_commits_from_names(tmp_path):
    assert results_index.entries(_tree(tmp_path)) == [
        {"benchmark": "e2e", "file": "benchmarks/results/e2e/e2e_x_abc1234.json", "device": "NVIDIA H100 80GB HBM3",
         "commit": "abc1234", "headline": "none 250.0 ms; full 312.5 ms",
         "beside": ["e2e_x_abc1234.log", "e2e_x_abc1234_extra.png"]},
        {"benchmark": "e2e", "file": "benchmarks/results/e2e/pytest_def5678.log", "device": "unrecorded",
         "commit": "def5678", "headline": "3 passed, 1 skipped in 2.00s", "beside": []},
    ]


def test_check_names_the_stale_files_and_writing_fixes_them(tmp_path, capsys):
    root = _tree(tmp_path)
    assert results_index.main(["--check", "--root", str(root)]) == 1
    assert capsys.readouterr().err == ("spartron: error: benchmarks/results/LATEST.json, benchmarks/results/README.md, "
                                       "docs/RESULTS.md out of date: run python benchmarks/results_index.py\n")
    assert results_index.main(["--root", str(root)]) == 0
    assert results_index.main(["--check", "--root", str(root)]) == 0
    assert "1 superseded files are under `archive/<name>/`" in (root / "benchmarks/results/README.md").read_text()


@pytest.mark.parametrize("case, message", [
    ("stray", "loose.json: results belong in benchmarks/results/<benchmark>/"),
    ("no_commit", "benchmarks/results/e2e/e2e_x_abc1234.json: no 'commit' (null only with a "
                  "'commit_note')"),
    ("no_headline", "benchmarks/results/e2e/e2e_x_abc1234.json: no headline (KeyError: "
                    "'step_time_s')"),
    ("unknown_folder", "benchmarks/results/newbench/: no headline for this benchmark (add one to "
                       "HEADLINES in benchmarks/results_index.py)"),
])
def test_bad_results_are_refused_by_name(tmp_path, capsys, case, message):
    root = _tree(tmp_path)
    results = root / "benchmarks" / "results"
    target = results / "e2e" / "e2e_x_abc1234.json"
    if case == "stray":
        (results / "loose.json").write_text("{}")
    elif case == "no_commit":
        target.write_text(json.dumps({"commit": None, "results": []}))
    elif case == "no_headline":
        target.write_text(json.dumps({"commit": "abc1234", "results": [{"mode": "none"}]}))
    else:
        (results / "newbench").mkdir()
    with pytest.raises(results_index.ResultsError) as e:
        results_index.entries(root)
    assert str(e.value) == message
    assert results_index.main(["--check", "--root", str(root)]) == 2
    assert capsys.readouterr().err == f"spartron: error: {message}\n"


def test_benchmarks_write_commit_not_git_commit():
    writers = [p.name for p in (ROOT / "benchmarks").glob("*.py") if '"git_commit":' in p.read_text()]
    assert writers == []
