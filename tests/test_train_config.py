"""TrainConfig: presets, precedence (preset < file < flags), a flag per field, batch
arithmetic, and one readable error listing every impossible value."""
import json
import re

import pytest

from roberta_fast.train_config import TRAIN_PRESETS, TrainConfig, field_help, build_parser, load_config


def test_defaults_are_the_tiny_preset():
    cfg = load_config([])
    assert cfg == TrainConfig.preset("tiny").validate()
    assert cfg.model == "tiny" and str(cfg.out_dir) == "runs/tiny"


def test_paper_presets():
    base, large = TrainConfig.preset("base"), TrainConfig.preset("large")
    for cfg in (base, large):
        assert (cfg.seq_len, cfg.global_batch_size, cfg.max_steps) == (512, 8192, 500_000)
        assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.clip_grad_norm) == (0.9, 0.98, 1e-6, 0.01, 0.0)
    assert (base.lr, base.warmup_steps, large.lr, large.warmup_steps) == (6e-4, 24_000, 4e-4, 30_000)
    # 8K sequences by accumulation x data parallelism
    assert base.resolve_batch(world_size=8) == (32, 8192)
    assert large.resolve_batch(world_size=64) == (8, 8192)
    assert TrainConfig.preset("base_fairseq").resolve_batch(world_size=8) == (16, 2048)
    for name in TRAIN_PRESETS:
        TrainConfig.preset(name).validate()


def test_every_field_has_a_flag_and_a_help_text():
    actions = {a.dest for a in build_parser()._actions}
    assert set(TrainConfig.__dataclass_fields__) <= actions
    assert set(field_help()) == set(TrainConfig.__dataclass_fields__)
    # fp16 overflow-skipped steps count toward max_steps but do not advance the LR schedule: the help
    # once promised that "the LR reaches min_lr here", which skipped steps break
    help_text = field_help()["max_steps"]
    assert "skipped ones included" in help_text and "only if none was skipped" in help_text


def test_precedence_preset_file_flags(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"preset": "base", "lr": 1e-4, "max-steps": 1000, "warmup_steps": 10}))
    cfg = load_config(["--config", str(f), "--max-steps", "2000", "--precision", "bf16", "--no-progress"])
    assert cfg.model == "base" and cfg.seq_len == 512  # from the preset
    assert cfg.lr == 1e-4  # from the file
    assert cfg.max_steps == 2000 and cfg.precision == "bf16" and cfg.progress is False  # flags win
    cfg = load_config(["--config", str(f), "--preset", "base_fairseq"])  # the flag's preset wins over the file's
    assert cfg.global_batch_size == 2048 and cfg.lr == 1e-4  # (that once failed: "unknown ... keys ['preset']")
    y = tmp_path / "run.yaml"
    y.write_text("lr: 2.0e-4\ngrad_accum: 4\nmasking: whole_word\nstop_at: null\n")
    pytest.importorskip("yaml")
    cfg = load_config(["--config", str(y), "--preset", "tiny", "--global-batch-size", "64"])
    assert (cfg.lr, cfg.grad_accum, cfg.masking, cfg.global_batch_size) == (2e-4, 4, "whole_word", 64)
    assert cfg.resolve_batch(1) == (4, 64)


def test_values_are_coerced_and_checked():
    cfg = TrainConfig.from_dict({"max_steps": "5e3", "lr": "1e-3", "stop_at": "none", "export": "false"})
    assert (cfg.max_steps, cfg.lr, cfg.stop_at, cfg.export) == (5000, 1e-3, None, False)
    with pytest.raises(ValueError, match="max_steps expects an int, got '2.5'"):
        TrainConfig.from_dict({"max_steps": "2.5"})
    assert TrainConfig.from_dict({"out": 2024}).out == "2024"  # YAML's reading of a directory name
    for value in (["a"], {"a": 1}, True):  # not text: refused, not str()-ed into a path
        with pytest.raises(ValueError, match=re.escape(f"out expects a str, got {value!r}")):
            TrainConfig.from_dict({"out": value})
    with pytest.raises(ValueError, match="unknown training config keys \\['lrate'\\]"):
        TrainConfig.from_dict({"lrate": 1})
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig.preset("huge")


def test_impossible_values_are_all_listed():
    cfg = TrainConfig(lr=0.0, batch_size=0, precision="fp8", masking="random", warmup_steps=10, max_steps=5,
                      mlm_probability=1.5, mask_replace_prob=0.9, random_replace_prob=0.2)
    with pytest.raises(ValueError) as err:
        cfg.validate()
    msg = str(err.value)
    for part in ("lr must be > 0", "batch_size must be a positive integer", "precision must be one of",
                 "masking must be one of", "warmup_steps (10) must not exceed max_steps (5)",
                 "mlm_probability must be in (0, 1)", "sum to at most 1"):
        assert part in msg


def test_inconsistent_batch_arithmetic():
    with pytest.raises(ValueError, match="global_batch_size 100 is not a multiple of batch_size 16 x 2"):
        TrainConfig(global_batch_size=100).resolve_batch(2)
    with pytest.raises(ValueError, match="set only two of them"):
        TrainConfig(grad_accum=2, global_batch_size=64).resolve_batch(4)
    assert TrainConfig(grad_accum=2, global_batch_size=64).resolve_batch(2) == (2, 64)


def test_bad_config_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(["--config", str(tmp_path / "nope.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(["--config", str(bad)])
    other = tmp_path / "cfg.toml"
    other.write_text("")
    with pytest.raises(ValueError, match="must end in .json, .yaml or .yml"):
        load_config(["--config", str(other)])
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(["--config", str(listed)])


def test_save_round_trips(tmp_path):
    cfg = TrainConfig.preset("large", seed=7)
    cfg.save(tmp_path / "c.json")
    assert TrainConfig.from_dict(json.loads((tmp_path / "c.json").read_text())) == cfg


def test_permissions_are_command_line_only(tmp_path):
    """--trust-checkpoint and --allow-schedule-change hold for one invocation: never saved
    with the run, and a --config file (maybe someone else's) cannot grant them."""
    cfg = load_config(["--trust-checkpoint", "--allow-schedule-change"])
    assert cfg.trust_checkpoint and cfg.allow_schedule_change
    cfg.save(tmp_path / "c.json")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert "trust_checkpoint" not in saved and "allow_schedule_change" not in saved
    assert not load_config(["--config", str(tmp_path / "c.json")]).trust_checkpoint
    granted = tmp_path / "granted.json"
    granted.write_text(json.dumps({"trust-checkpoint": True}))
    with pytest.raises(ValueError, match="trust_checkpoint cannot be set in a --config file"):
        load_config(["--config", str(granted)])


def test_a_short_run_scales_the_presets_warmup(tmp_path, capsys):
    """--max-steps below the preset's keeps the preset's warmup share (tiny: 30 of 300 steps) and
    says so; an explicit --warmup-steps beyond --max-steps stays an error. Before, only a run shorter
    than the warmup was scaled: --max-steps 30 warmed up for all 30 steps and never decayed."""
    assert load_config(["--max-steps", "12"]).warmup_steps == 1
    assert ("tiny preset warms up for 30 of its 300 steps: --max-steps 12 warms up for 1 step(s), the same 10.0%"
            in capsys.readouterr().out)
    assert load_config(["--preset", "base", "--max-steps", "10000"]).warmup_steps == 480  # 24k of 500k
    for max_steps, warmup in ((30, 3), (31, 3), (100, 10), (299, 30), (300, 30), (1000, 30)):
        assert TrainConfig.preset("tiny", max_steps=max_steps).warmup_steps == warmup
    assert TrainConfig.preset("base", max_steps=100_000).warmup_steps == 4_800
    capsys.readouterr()
    load_config(["--max-steps", "300"])
    assert "note" not in capsys.readouterr().out  # the preset's own length: nothing scaled
    f = tmp_path / "short.json"
    f.write_text(json.dumps({"max_steps": 20}))
    assert load_config(["--config", str(f)]).warmup_steps == 2
    for argv in (["--max-steps", "12", "--warmup-steps", "30"], ["--config", str(f), "--warmup-steps", "30"]):
        with pytest.raises(ValueError, match=r"warmup_steps \(30\) must not exceed max_steps"):
            load_config(argv)
