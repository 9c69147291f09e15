"""What a person reads while and after a run trains: the step line (loss, grad norm, lr, step time, tokens/s,
peak memory) and the end-of-run summary (human units, total time, the last saved step)."""

from __future__ import annotations

from spartron.launch.cli import main
from spartron.runtime.metrics import print_summary, step_info

GIB = 2**30
RECORD = {"type": "step", "step": 3, "loss": 8.05541, "grad_norm": 1.10234, "lr": 5.5e-4, "step_time_s": 0.2117,
          "tokens_per_s": 38712.4, "tokens_per_s_per_gpu": 38712.4, "mfu": 0.41234,
          "peak_memory_allocated_bytes": 55.9 * GIB, "expert_load_max_violation": 0.65625}


def test_step_line_has_step_time_learning_rate_and_peak_memory():
    assert step_info(RECORD) == "loss 8.0554 gnorm 1.102 lr 0.00055 time 211.7 ms 38,712 tok/s mem 55.90 GiB"
    slow = {**RECORD, "step_time_s": 6.094, "val_loss": 6.07912, "val_ppl": 436.9}
    assert step_info(slow).endswith("time 6.09 s 38,712 tok/s mem 55.90 GiB val 6.0791 (ppl 436.9)")
    # a record without the newer fields (an older metrics.jsonl, a benchmark's own record) still prints
    assert step_info({"loss": 1.0, "grad_norm": 0.5, "tokens_per_s": 10.0}) == "loss 1.0000 gnorm 0.500 10 tok/s"


def test_summary_uses_human_units_and_ends_with_total_time_and_saved_step(capsys):
    records = [{**RECORD, "step": 1, "loss": 8.1}, {**RECORD, "step": 2, "mfu": 0.5, "step_time_s": 1.5}]
    print_summary(records, None, total_s=754.2, saved="2 (runs/x/step-00000002)")
    err = capsys.readouterr().err
    assert "spartron: 2 steps (steps 1-2)" in err
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in err.splitlines() if line.startswith("│")}
    assert rows["MFU"] == ["41.23%", "50.00%", "45.62%"]  # the median of two: their mean (it took the upper one)
    assert rows["peak memory allocated"] == ["55.90 GiB"] * 3
    assert rows["step time"] == ["211.7 ms", "1.50 s", "855.9 ms"]
    assert rows["tokens/s"] == ["38,712"] * 3
    assert "validation loss" not in rows  # no step evaluated
    assert err.rstrip().splitlines()[-1] == "spartron: total time 0:12:34 h; last saved step: 2 (runs/x/step-00000002)"
    print_summary(records, None, total_s=3.0, saved=None)
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == "spartron: total time 3.00 s; last saved step: none"


def test_version_flag(capsys):
    import spartron

    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out == f"spartron {spartron.__version__}\n"
