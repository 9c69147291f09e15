"""Run config: TOML round trip, overrides, and every kind of bad input with its message."""

from __future__ import annotations

from pathlib import Path

import pytest

from spartron.runtime.config import ConfigError, RunConfig, dump_config, load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def test_tiny_round_trip(tmp_path):
    config = load_config(TINY)
    assert (config.name, config.model.dim, config.model.moe.n_routed_experts) == ("tiny", 64, 8)
    assert config.train.lr == 1e-3
    path = tmp_path / "again.toml"
    path.write_text(dump_config(config))
    again = load_config(path)
    assert again == config
    assert dump_config(again) == dump_config(config)


def test_round_trip_of_non_default_values(tmp_path):
    config = load_config(TINY, ["parallel.cp=2", "parallel.order=tp-dp-cp-ep-pp", "train.lr=2.5e-4",
                                'name="a \\"quoted\\" name"', "ac.mode=full"])
    path = tmp_path / "again.toml"
    path.write_text(dump_config(config))
    assert load_config(path) == config
    assert (config.parallel.cp, config.parallel.order, config.train.lr, config.name) == (
        2, "tp-dp-cp-ep-pp", 2.5e-4, 'a "quoted" name')


def test_defaults_and_overrides():
    assert load_config() == RunConfig()
    config = load_config(TINY, ["parallel.ep=2", "train.steps=7", "device=cpu"])
    assert (config.parallel.ep, config.train.steps, config.device) == (2, 7, "cpu")
    assert load_config(TINY, ["train.lr=1"]).train.lr == 1.0  # an int for a float is fine


@pytest.mark.parametrize("overrides,message", [
    # unknown keys
    (["parallel.foo=1"], "invalid config: parallel.foo: unknown key"),
    (["bogus=1"], "invalid config: bogus: unknown key"),
    (["model.moe.n_expert=4"], "invalid config: model.moe.n_expert: unknown key"),
    # wrong types
    (['parallel.ep="2"'], "invalid config: parallel.ep: Input should be a valid integer (got '2')"),
    (['train.lr="fast"'], "invalid config: train.lr: Input should be a valid number (got 'fast')"),
    (["train.compile=1"], "invalid config: train.compile: Input should be a valid boolean (got 1)"),
    (["parallel=3"], "invalid config: parallel: Input should be a valid dictionary"),
    (["device=tpu"], "invalid config: device: Input should be 'auto', 'cpu' or 'cuda' (got 'tpu')"),
    # out of range
    (["parallel.ep=0"], "invalid config: parallel.ep: Input should be greater than or equal to 1 (got 0)"),
    (["parallel.fsdp=0"], "invalid config: parallel.fsdp must be >= 1 or -1 (fill the remaining ranks)"),
    (["parallel.order=tp-dp-pp"],
     "invalid config: parallel.order must be a '-'-joined permutation of tp-cp-ep-dp-pp (megatron-core's names), "
     "got 'tp-dp-pp'"),
    # contradictory values
    (["parallel.ep=3"], "invalid config: model.moe.n_routed_experts 8 must be divisible by parallel.ep 3"),
    (["parallel.ep=2", "model.moe.dispatcher=local"],
     "invalid config: model.moe.dispatcher = 'local' cannot serve an EP group of 2 ranks; use 'all_to_all' or "
     "'deepep'"),
    (["offload.enabled=true", "ac.mode=none"],
     "invalid config: offload.enabled needs checkpoint regions: set ac.mode to 'full' or 'selective'"),
    (["parallel.cp=3"], "invalid config: train.seq_len 64 must be divisible by 2 * parallel.cp (6)"),
    (["train.compile=true", "ac.reentrant=true"],  # tiny.toml has ac.mode = "selective"
     "invalid config: train.compile = true with ac.mode = 'selective' needs ac.reentrant = false"),
    (["train.compile=true", "ac.debug_summary=true"],
     "invalid config: ac.debug_summary is set but train.compile = true: a compiled region keeps no per-op stats"),
    (["parallel.nccl.epx.max_ctas=8"],
     "invalid config: parallel.nccl: unknown group 'epx'; known: world, cp, fsdp"),
    (["parallel.nccl.ep.min_ctas=16", "parallel.nccl.ep.max_ctas=8"],
     "invalid config: parallel.nccl.ep: min_ctas = 16 is above max_ctas = 8"),
    (["parallel.nccl.ep.max_ctas=0"],
     "invalid config: parallel.nccl.ep.max_ctas: Input should be greater than or equal to 1 (got 0)"),
    (["parallel.nccl.ep.ctas=8"], "invalid config: parallel.nccl.ep.ctas: unknown key"),
    (["parallel.nccl.ep.max_ctas=8", "parallel.backend=gloo"],
     "invalid config: parallel.nccl configures NCCL communicators, but parallel.backend = 'gloo'"),
    # bad override syntax
    (["parallel.ep"], "override 'parallel.ep' must look like dotted.key=value"),
    (["=3"], "override '=3' must look like dotted.key=value (empty key part in '')"),
    (["parallel..ep=2"], "override 'parallel..ep=2' must look like dotted.key=value (empty key part in"),
    (["name.x=1"], "override name.x: name is a value, not a section"),
])
def test_bad_config(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert message in str(err.value)


def test_nccl_settings_per_group():
    config = load_config(TINY, ["parallel.nccl.ep.max_ctas=16", "parallel.nccl.ep.cga_cluster_size=2"])
    assert config.parallel.nccl_settings() == {"ep": {"max_ctas": 16, "cga_cluster_size": 2}}
    assert load_config(TINY).parallel.nccl == {}


def test_several_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["parallel.foo=1", 'train.steps="x"'])
    assert str(err.value) == ("invalid config: parallel.foo: unknown key; "
                              "train.steps: Input should be a valid integer (got 'x')")


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*missing.toml' does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[parallel\nep = 2\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(broken)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[parallel]\nep = 2\nexpert_parallel = 2\n")
    with pytest.raises(ConfigError, match="parallel.expert_parallel: unknown key"):
        load_config(unknown)


def test_config_links_that_lead_nowhere_say_so(tmp_path):
    loop, dangling = tmp_path / "loop.toml", tmp_path / "dangling.toml"
    loop.symlink_to("loop.toml")
    dangling.symlink_to("gone.toml")
    with pytest.raises(ConfigError) as err:
        load_config(loop)
    assert str(err.value) == (f"config file {str(loop)!r} is a symbolic link that loops (to 'loop.toml'): "
                              "point it at a TOML file")
    with pytest.raises(ConfigError) as err:
        load_config(dangling)
    assert str(err.value) == (f"config file {str(dangling)!r} is a dangling symbolic link (to 'gone.toml'): "
                              "its target does not exist")
    with pytest.raises(ConfigError) as err:
        load_config(loop / "x.toml")
    assert str(err.value) == (f"config file {str(loop / 'x.toml')!r} cannot be reached: a folder on its path is a "
                              "symbolic link that loops")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"config file {str(tmp_path)!r} is not a regular file"


def test_compile_makes_an_unset_ac_reentrant_non_reentrant(tmp_path):
    cfg = load_config("configs/tiny.toml", ["train.compile=true"])  # tiny.toml: ac.mode = "selective"
    assert cfg.ac.reentrant is False
    assert load_config("configs/tiny.toml", ["train.compile=true", "ac.reentrant=false"]).ac.reentrant is False
    assert load_config("configs/tiny.toml", []).ac.reentrant is True  # eager keeps the reentrant default
    assert load_config("configs/tiny.toml", ["train.compile=true", "ac.mode=none"]).ac.reentrant is True
    path = tmp_path / "run.toml"
    path.write_text(dump_config(cfg))  # the resolved value is written, so the dump loads the same
    assert load_config(path).ac == cfg.ac


def test_the_reentrant_default_is_resolved_without_changing_what_was_passed():
    from spartron.checkpointing.config import ACConfig
    from spartron.runtime.config import TrainConfig

    ac = ACConfig(mode="full")
    cfg = RunConfig(name="t", train=TrainConfig(compile=True), ac=ac)
    assert (cfg.ac.reentrant, ac.reentrant, "reentrant" in cfg.ac.model_fields_set) == (False, True, True)
    eager = RunConfig(name="t", ac=ac)
    assert eager.ac.reentrant is True
    with pytest.raises(ValueError, match="with ac.mode = 'selective' needs ac.reentrant = false"):
        cfg.ac = ACConfig(mode="selective")  # an assigned section is checked, not resolved: say it explicitly
    with pytest.raises(ValueError, match="train.compile = true with ac.mode = 'full' needs ac.reentrant = false"):
        RunConfig(name="t", train=TrainConfig(compile=True), ac=ACConfig(mode="full", reentrant=True))
    with pytest.raises(ValueError, match="train\n  Input should be a valid dictionary or instance of TrainConfig"):
        RunConfig.model_validate({"name": "t", "train": 3, "ac": {"mode": "full"}})
