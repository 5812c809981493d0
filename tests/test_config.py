"""The command line and its configuration (config.py): one flag builder for train.py and eval.py, --config
files, --help, flags without effect, numeric flags.
"""
import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict, fields, replace

import pytest
import torch

import config
import eval as ev
import run_folder
import train
from command_line import flags
from rollout import INSTRUCTION
from tests.toy_task import EVEN, ROOT, one_thread, patch_toy_task, read_metrics, toy_args, toy_data


def test_eval_cli_flags_and_help(capsys):
    cfg = ev.parse_config(["--models", "a", "lbl=b", "--benchmarks", "gsm8k", "--no-chat", "--k", "8",
                           "--preset", "justrl", "--max-new-tokens", "16"])
    assert cfg == ev.Config(models=["a", "lbl=b"], benchmarks=["gsm8k"], chat=False, k=8, preset="justrl",
                            max_new_tokens=16, temperature=0.7, top_p=0.9, instruction=INSTRUCTION, seed=0,
                            out="out/eval")
    assert ev.parse_config([]) == ev.Config(temperature=1.0, top_p=1.0, instruction=INSTRUCTION, seed=0,
                                            out="out/eval")
    assert ev.parse_config(["--preset", "justrl", "--temperature", "0.5"]).top_p == 0.9  # a flag beats the preset
    assert ev.parse_config(["--instruction", ""]).instruction == ""  # no instruction, not the default one
    with pytest.raises(SystemExit):
        ev.parse_config(["--preset", "greedy"])
    with pytest.raises(SystemExit):
        ev.parse_config(["--help"])
    assert "temperature 0.7, top-p 0.9" in capsys.readouterr().out


def test_cli_one_builder_for_train_and_eval(capsys):
    """train.py and eval.py build their CLI with the same flags.parse_flags: only the flags given come back, every
    Config field is a --flag whose help is its docstring, and a bad flag is one line with exit status 2 in both."""
    assert ev.flags.parse_flags is flags.parse_flags  # the one builder; train.py calls it through config.parse_config
    assert flags.parse_flags(ev.Config, ["--k", "8", "--no-chat", "--data", "a.jsonl", "b=c.jsonl"],
                              "eval.py") == {"k": 8, "chat": False, "data": ["a.jsonl", "b=c.jsonl"]}
    assert flags.parse_flags(config.Config, ["--clip-low", "none", "--lr", "1e-3", "--no-save-optimizer"],
                              "train.py") == {"clip_low": None, "lr": 1e-3, "save_optimizer": False}
    for cls, main, prog in ((config.Config, train.main, "train.py"), (ev.Config, ev.main, "eval.py")):
        with pytest.raises(SystemExit):
            flags.parse_flags(cls, ["--help"], prog)
        help_text = " ".join(capsys.readouterr().out.split())
        for f in fields(cls):
            assert "--" + f.name.replace("_", "-") in help_text, (prog, f.name)
        with pytest.raises(SystemExit) as e:
            main(["--steps" if main is train.main else "--k", "x"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: argument"), err
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    assert "[default: 'Qwen/Qwen3-1.7B-Base' (cpu preset: 'smollm2')]" in " ".join(capsys.readouterr().out.split())
    # eval.py imports torch only after parsing, so `python eval.py --help` stays fast
    proc = subprocess.run([sys.executable, "-c", "import sys, eval; print('torch' in sys.modules)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_cli_config_file_is_the_base_layer_under_the_flags(tmp_path, capsys):
    """--config FILE (JSON, a run's own config.json included, or YAML) gives flag values as if they were given, the
    command line wins over them, in train.py and eval.py alike; an unknown key or a value of the wrong type is one
    line naming the file and the key, exit status 2. check_values is the validator (the lead's resume uses it)."""
    data = toy_data(tmp_path)
    recipe = config.parse_config(toy_args(data, tmp_path / "x", lr=0.002, algo="justrl"))[0]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps(run_folder.recipe(asdict(recipe))))
    rerun = config.parse_config(["--config", str(tmp_path / "x" / "config.json"), "--seed", "1", "--out-dir",
                                str(tmp_path / "x-seed1")])[0]
    assert rerun == replace(recipe, seed=1, out_dir=str(tmp_path / "x-seed1"))  # python train.py --config ... reruns it
    (tmp_path / "r.yaml").write_text("model: tiny\ndata: " + data + "\nanswer_key: answer\nchat: false\nlr: 1e-4\n"
                                     "steps: 3\nclip_low: null\nout_dir: " + str(tmp_path / "y") + "\n")
    cfg = config.parse_config(["--config", str(tmp_path / "r.yaml"), "--steps", "2"])[0]
    assert (cfg.model, cfg.lr, cfg.steps, cfg.chat, cfg.clip_low) == ("tiny", 1e-4, 2, False, None)
    (tmp_path / "e.json").write_text(json.dumps({"benchmarks": ["gsm8k"], "k": 8, "temperature": 0.7, "seed": 3}))
    cfg = ev.parse_config(["--config", str(tmp_path / "e.json"), "--k", "2"])
    assert (cfg.benchmarks, cfg.k, cfg.temperature, cfg.seed) == (["gsm8k"], 2, 0.7, 3)
    assert flags.check_values(config.Config, {"lr": 1, "steps": 2, "clip_low": None}, "src") == {
        "lr": 1.0, "steps": 2, "clip_low": None}
    cases = {"bad_str.json": ('{"temperature": "0.7"}', "'temperature' must be a number | not the text '0.7'"),
             "bad_bool.json": ('{"temperature": true}', "'temperature' must be a number | not a boolean"),
             "bad_int.json": ('{"seed": 2.5}', "'seed' must be an integer | not the number 2.5"),
             "flag.json": ('{"chat": 1}', "'chat' must be true or false, not the number 1"),
             "typo.json": ('{"temprature": 0.1}', "unknown key 'temprature' (did you mean 'temperature'?)"),
             "dash.json": ('{"top-p": 0.9}', "unknown key 'top-p' (did you mean 'top_p'?)"),
             "list.json": ('[1]', "not a mapping of flag names to values but a list"),
             "broken.json": ('{"seed": }', "not JSON (Expecting value: line 1 column 10 (char 9))"),
             "broken.yaml": ("seed: [1", "not YAML"),
             "deep.json": ('{"seed": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested too deeply to read"),
             "deep.yaml": ("seed: " + "[" * 5_000 + "]" * 5_000, "nested too deeply to read"),  # it printed 2,999 lines
             "missing.json": (None, "cannot be read (No such file or directory)")}
    for name, (text, expected) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        for module, prog in ((config, "train.py"), (ev, "eval.py")):
            with pytest.raises(SystemExit) as e:
                module.parse_config(["--config", str(tmp_path / name)])
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: ") and \
                str(tmp_path / name) in err[0] and all(part in err[0] for part in expected.split(" | ")), (name, err)
    (tmp_path / "bench.json").write_text('{"benchmarks": "gsm8k"}')
    with pytest.raises(ValueError, match="'benchmarks' must be a list of strings, not the text 'gsm8k'"):
        flags.read_config(ev.Config, str(tmp_path / "bench.json"))


def test_cli_misspelled_flags_are_named_and_abbreviations_refused(capsys):
    """A misspelled flag gets "did you mean" (it got only `unrecognized arguments: --stesp 3`) and a prefix of a flag
    is refused, with the flag it shortens named (`--ste 3` was taken for `--steps 3`), in train.py and eval.py."""
    for cls, argv, expected in (
            (config.Config, ["--stesp", "3"], "train.py: error: unrecognized arguments: --stesp 3 (did you mean "
                                               "--steps?)"),
            (config.Config, ["--ste", "3"], "train.py: error: unrecognized arguments: --ste 3 (did you mean "
                                             "--steps?)"),
            (config.Config, ["--lr", "1", "--temprature=0.5"], "train.py: error: unrecognized arguments: "
                                                               "--temprature=0.5 (did you mean --temperature?)"),
            (config.Config, ["--zzz"], "train.py: error: unrecognized arguments: --zzz"),
            (ev.Config, ["--mod", "x"], "eval.py: error: unrecognized arguments: --mod x (did you mean --models?)")):
        with pytest.raises(SystemExit) as e:
            flags.parse_flags(cls, argv, "train.py" if cls is config.Config else "eval.py")
        assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [expected]


def test_train_light_is_one_flag_for_little_disk(tmp_path):
    """--light sets what a small experiment keeps on disk (no export, a weights-only checkpoint, one, at the end), and a
    flag given beside it wins."""
    out = ["--out-dir", str(tmp_path / "run")]
    cfg = config.parse_config(["--light", *out])[0]
    assert (cfg.light, cfg.export_hf, cfg.save_optimizer, cfg.keep_checkpoints, cfg.save_every) == (True, False, False,
                                                                                                     1, 0)
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
    """--eval-samples 0 skips the held-out evaluation (it crashed: max() of an empty sequence); out-of-range numbers
    are one-line errors before anything is loaded or written."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "noeval", heldout=2, eval_samples=0, export_hf=False)) == 0
    assert not (tmp_path / "noeval" / "eval.jsonl").exists() and len(read_metrics(tmp_path / "noeval")) == 1
    assert "held-out accuracy" not in capsys.readouterr().out
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    for flag, value, expected in [("eval_samples", -1, "--eval-samples must be >= 0 (got -1)"),
                                  ("max_tokens_per_micro_batch", 0, "--max-tokens-per-micro-batch must be >= 1"),
                                  ("group_size", 1, "--group-size must be >= 2"),
                                  ("samples_per_step", -2, "--samples-per-step must be >= 0"),
                                  ("top_p", 0.0, "--top-p must be in (0, 1]"),
                                  ("quantile", 1.5, "--quantile must be in"),
                                  ("steps", 0, "--steps must be >= 1")]:
        assert train.main(toy_args(data, tmp_path / "bad", **{flag: value})) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"train.py: error: {err[0].removeprefix('train.py: error: ')}"] and expected in err[0], err
    assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what CPU-only flags do")
def test_train_flags_without_effect_warn_and_config_records_what_ran(tmp_path, monkeypatch, capsys):
    """--mixed-precision needs CUDA and --kl-beta needs GRPO: each warns in one line, and config.json records the
    values the run used (mixed_precision false; fsdp true, the model was sharded; kl_beta 0)."""
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", mixed_precision=True, fsdp=True,
                                    kl_beta=0.1, export_hf=False)) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.py: warning:")]
    assert warned == [
        "train.py: warning: --mixed-precision True has no effect without CUDA (compute is fp32); config.json records "
        "mixed_precision = False",
        "train.py: warning: --kl-beta 0.1 has no effect with --algo stapo (GRPO only); config.json records "
        "kl_beta = 0.0"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["mixed_precision"], config["fsdp"], config["kl_beta"]) == (False, True, 0.0)


def test_train_rollout_auto_is_vllm_on_cuda_when_installed(monkeypatch, capsys):
    """--rollout auto (the default): vLLM on CUDA when it is installed; the plain sampler without CUDA, or on CUDA
    without vLLM (one note line); config.json records the engine chosen."""
    from importlib.util import find_spec

    cfg = config.Config()
    assert cfg.rollout == "auto" and config.in_effect(cfg, {}, cuda=False, world=1) == (replace(
        cfg, rollout="plain", fsdp=False, mixed_precision=False), [])
    assert config.in_effect(cfg, {}, cuda=True, world=1)[0].rollout == ("vllm" if find_spec("vllm") else "plain")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    chosen, notes = config.in_effect(cfg, {}, cuda=True, world=1)
    assert chosen.rollout == "plain" and len(notes) == 1, notes
    assert notes[0].startswith("note: --rollout auto samples with the plain sampler")
    assert config.in_effect(replace(cfg, rollout="plain"), {}, cuda=True, world=1) == (replace(
        cfg, rollout="plain", fsdp=True), [])


def test_stop_text_is_repeatable_inherited_by_eval_and_never_empty(tmp_path, capsys):
    """--stop-text A --stop-text B gives both (so does any list flag: --models a --models b); eval.py --run takes
    the run's texts; an empty text is a one-line error."""
    assert flags.parse_flags(config.Config, ["--stop-text", "\n\n", "--stop-text", "Q:"], "train.py") == \
        {"stop_text": ["\n\n", "Q:"]}
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
