"""config.py: what a run is told: --light, --help, --stop-text, numeric flags, flags without effect,
the values in effect on this machine (the flag builder and --config files:
tests/test_command_line_flags.py).
"""
import importlib.util
import json
from dataclasses import asdict, replace

import pytest
import torch

import config
import eval as ev
import run_folder
import train
from command_line import flags
from tests.toy_task import EVEN, one_thread, patch_toy_task, read_metrics, toy_args, toy_data


def test_train_light_is_one_flag_for_little_disk(tmp_path):
    """--light sets what a small experiment keeps on disk (no export, a weights-only checkpoint,
    one, at the end), and a flag given beside it wins."""
    out = ["--out-dir", str(tmp_path / "run")]
    cfg = config.parse_config(["--light", *out])[0]
    assert (cfg.light, cfg.export_hf, cfg.save_optimizer, cfg.keep_checkpoints, cfg.save_every) == \
        (True, False, False, 1, 0)
    assert config.parse_config(["--light", "--save-every", "2", *out])[0].save_every == 2
    assert config.parse_config(out)[0].export_hf and "light" in run_folder.RESUMABLE


def test_train_help_lists_plot_apart_from_plots(capsys):
    """train.py --help lists --plot among its options, apart from --plots and told apart from it."""
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "other modes: --plot RUN [RUN ...] redraw the figures of finished runs" in text
    assert "(not --plots, which draws this run's at its end)" in text and "--config FILE" in text


def test_train_eval_samples_zero_and_numeric_flags(tmp_path, monkeypatch, capsys):
    """--eval-samples 0 skips the held-out evaluation (it crashed: max() of an empty sequence);
    out-of-range numbers are one-line errors before anything is loaded or written."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "noeval", heldout=2, eval_samples=0,
                                    export_hf=False)) == 0
    assert not (tmp_path / "noeval" / "eval.jsonl").exists() and \
        len(read_metrics(tmp_path / "noeval")) == 1
    assert "held-out accuracy" not in capsys.readouterr().out
    monkeypatch.setattr("startup.run.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    for flag, value, expected in [("eval_samples", -1, "--eval-samples must be >= 0 (got -1)"),
                                  ("max_tokens_per_micro_batch", 0,
                                   "--max-tokens-per-micro-batch must be >= 1"),
                                  ("group_size", 1, "--group-size must be >= 2"),
                                  ("samples_per_step", -2, "--samples-per-step must be >= 0"),
                                  ("top_p", 0.0, "--top-p must be in (0, 1]"),
                                  ("quantile", 1.5, "--quantile must be in"),
                                  ("steps", 0, "--steps must be >= 1")]:
        assert train.main(toy_args(data, tmp_path / "bad", **{flag: value})) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"train.py: error: {err[0].removeprefix('train.py: error: ')}"] and \
            expected in err[0], err
    assert not (tmp_path / "bad").exists()


def test_train_seed_and_quantile_window_ranges_are_checked_before_the_folder(
        tmp_path, monkeypatch, capsys):
    """Any 64-bit --seed trains (2**63 - 1 included); one beyond, or a --quantile-window too large
    to hold, is one line naming the flag before the run folder is made, so the corrected command
    runs. (--seed 2**63 failed after the held-out evaluation with "Overflow when unpacking long
    long", naming no flag, and its half-opened folder refused the corrected rerun; --quantile-window
    10**30 printed a PyTorch slice warning in every step.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    for flag, value, rule in (("seed", 2**63, "be a 64-bit integer"),
                              ("quantile_window", 10**30, "be <= 10**9")):
        assert train.main(toy_args(data, run, heldout=2, **{flag: value})) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"train.py: error: --{flag.replace('_', '-')} must {rule} (got {value})"]
        assert not run.exists()
    with one_thread():
        assert train.main(toy_args(data, run, heldout=2, seed=2**63 - 1, export_hf=False)) == 0
    assert read_metrics(run)[0]["step"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what CPU-only flags do")
def test_train_flags_without_effect_warn_and_config_records_what_ran(tmp_path, monkeypatch, capsys):
    """--mixed-precision needs CUDA and --kl-beta needs GRPO: each warns in one line, and
    config.json records the values the run used (mixed_precision false; fsdp true, the model was
    sharded; kl_beta 0)."""
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", mixed_precision=True,
                                    fsdp=True, kl_beta=0.1, export_hf=False)) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.py: warning:")]
    assert warned == [
        "train.py: warning: --mixed-precision True has no effect without CUDA (compute is fp32); "
        "config.json records mixed_precision = False",
        "train.py: warning: --kl-beta 0.1 has no effect with --algo stapo (GRPO only); config.json "
        "records kl_beta = 0.0"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["mixed_precision"], config["fsdp"], config["kl_beta"]) == (False, True, 0.0)


def test_train_rollout_auto_is_vllm_on_cuda_when_installed(monkeypatch, capsys):
    """--rollout auto (the default): vLLM on CUDA when it is installed; the plain sampler without
    CUDA, or on CUDA without vLLM (one note line); config.json records the engine chosen."""
    from importlib.util import find_spec

    cfg = config.Config()
    assert cfg.rollout == "auto" and config.in_effect(cfg, {}, cuda=False, world=1) == (replace(
        cfg, rollout="plain", fsdp=False, mixed_precision=False), [])
    assert config.in_effect(cfg, {}, cuda=True, world=1)[0].rollout == \
        ("vllm" if find_spec("vllm") else "plain")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "vllm" else find_spec(name))
    chosen, notes = config.in_effect(cfg, {}, cuda=True, world=1)
    assert chosen.rollout == "plain" and len(notes) == 1, notes
    assert notes[0].startswith("note: --rollout auto samples with the plain sampler")
    assert config.in_effect(replace(cfg, rollout="plain"), {}, cuda=True, world=1) == (replace(
        cfg, rollout="plain", fsdp=True), [])


def test_stop_text_is_repeatable_inherited_by_eval_and_never_empty(tmp_path, capsys):
    """--stop-text A --stop-text B gives both (so does any list flag: --models a --models b);
    eval.py --run takes the run's texts; an empty text is a one-line error."""
    assert flags.parse_flags(config.Config, ["--stop-text", "\n\n", "--stop-text", "Q:"],
                             "train.py") == {"stop_text": ["\n\n", "Q:"]}
    assert ev.parse_config(["--models", "a", "--models", "b"]).models == ["a", "b"]
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    recorded = {**asdict(config.Config()), "stop_text": ["\n\n"], "data": ""}
    (run / "config.json").write_text(json.dumps(recorded))
    assert ev.parse_config(["--run", str(run)]).stop_text == ["\n\n"]
    assert ev.parse_config(["--run", str(run), "--stop-text", "X"]).stop_text == ["X"]
    del recorded["stop_text"]  # a run made before the flag: no stop text
    (run / "config.json").write_text(json.dumps(recorded))
    assert ev.parse_config(["--run", str(run)]).stop_text == []
    with pytest.raises(ValueError, match="--stop-text '' would end every response"):
        config.parse_config(["--stop-text", "", "--out-dir", str(tmp_path / "x")])
