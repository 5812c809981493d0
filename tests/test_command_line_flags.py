"""command_line/flags.py: one flag builder for train.py and eval.py (every field a --flag, its
docstring the --help), --config files as the base layer under the flags, misspelled flags and
abbreviations.
"""
import json
import subprocess
import sys
from dataclasses import asdict, fields, replace

import pytest

import config
import eval as ev
import run_folder
import train
from command_line import flags
from tests.toy_task import ROOT, toy_args, toy_data


# ==================================================================================================
# command_line/flags.py: parse_flags, read_config, check_values
# ==================================================================================================
def test_cli_one_builder_for_train_and_eval(capsys):
    """train.py and eval.py build their CLI with the same flags.parse_flags: only the flags given
    come back, every Config field is a --flag whose help is its docstring, and a bad flag is one
    line with exit status 2 in both."""
    # the one builder; train.py calls it through config.parse_config
    assert ev.flags.parse_flags is flags.parse_flags
    assert flags.parse_flags(ev.Config, ["--k", "8", "--no-chat", "--data", "a.jsonl", "b=c.jsonl"],
                              "eval.py") == {"k": 8, "chat": False,
                                             "data": ["a.jsonl", "b=c.jsonl"]}
    assert flags.parse_flags(config.Config, ["--clip-low", "none", "--lr", "1e-3",
                                             "--no-save-optimizer"], "train.py") == \
        {"clip_low": None, "lr": 1e-3, "save_optimizer": False}
    for cls, main, prog in ((config.Config, train.main, "train.py"),
                            (ev.Config, ev.main, "eval.py")):
        with pytest.raises(SystemExit):
            flags.parse_flags(cls, ["--help"], prog)
        help_text = " ".join(capsys.readouterr().out.split())
        for f in fields(cls):
            assert "--" + f.name.replace("_", "-") in help_text, (prog, f.name)
        with pytest.raises(SystemExit) as e:
            main(["--steps" if main is train.main else "--k", "x"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and \
            err[0].startswith(f"{prog}: error: argument"), err
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    assert "[default: 'Qwen/Qwen3-1.7B-Base' (cpu preset: 'smollm2')]" in \
        " ".join(capsys.readouterr().out.split())
    # eval.py imports torch only after parsing, so `python eval.py --help` stays fast
    proc = subprocess.run([sys.executable, "-c", "import sys, eval; print('torch' in sys.modules)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_cli_config_file_is_the_base_layer_under_the_flags(tmp_path, capsys):
    """--config FILE (JSON, a run's own config.json included, or YAML) gives flag values as if they
    were given, the command line wins over them, in train.py and eval.py alike; an unknown key or a
    value of the wrong type is one line naming the file and the key, exit status 2. check_values is
    the validator (the lead's resume uses it)."""
    data = toy_data(tmp_path)
    recipe = config.parse_config(toy_args(data, tmp_path / "x", lr=0.002, algo="justrl"))[0]
    (tmp_path / "x").mkdir()
    run_folder.write_config(tmp_path / "x", asdict(recipe))  # train.py's, with its "code"
    assert set(json.loads((tmp_path / "x" / "config.json").read_text())["code"]) == {
        "commit", "dirty"}
    rerun = config.parse_config(["--config", str(tmp_path / "x" / "config.json"), "--seed", "1",
                                 "--out-dir", str(tmp_path / "x-seed1")])[0]
    # python train.py --config ... reruns it
    assert rerun == replace(recipe, seed=1, out_dir=str(tmp_path / "x-seed1"))
    (tmp_path / "r.yaml").write_text("model: tiny\ndata: " + data + "\nanswer_key: answer\n"
                                     "chat: false\nlr: 1e-4\nsteps: 3\nclip_low: null\nout_dir: "
                                     + str(tmp_path / "y") + "\n")
    cfg = config.parse_config(["--config", str(tmp_path / "r.yaml"), "--steps", "2"])[0]
    assert (cfg.model, cfg.lr, cfg.steps, cfg.chat, cfg.clip_low) == ("tiny", 1e-4, 2, False, None)
    (tmp_path / "e.json").write_text(json.dumps({"benchmarks": ["gsm8k"], "k": 8,
                                                 "temperature": 0.7, "seed": 3}))
    cfg = ev.parse_config(["--config", str(tmp_path / "e.json"), "--k", "2"])
    assert (cfg.benchmarks, cfg.k, cfg.temperature, cfg.seed) == (["gsm8k"], 2, 0.7, 3)
    assert flags.check_values(config.Config, {"lr": 1, "steps": 2, "clip_low": None}, "src") == {
        "lr": 1.0, "steps": 2, "clip_low": None}
    cases = {"bad_str.json": ('{"temperature": "0.7"}',
                              "'temperature' must be a number | not the text '0.7'"),
             "bad_bool.json": ('{"temperature": true}',
                               "'temperature' must be a number | not a boolean"),
             "bad_int.json": ('{"seed": 2.5}', "'seed' must be an integer | not the number 2.5"),
             "flag.json": ('{"chat": 1}', "'chat' must be true or false, not the number 1"),
             "typo.json": ('{"temprature": 0.1}',
                           "unknown key 'temprature' (did you mean 'temperature'?)"),
             "dash.json": ('{"top-p": 0.9}', "unknown key 'top-p' (did you mean 'top_p'?)"),
             "list.json": ('[1]', "not a mapping of flag names to values but a list"),
             "broken.json": ('{"seed": }', "not JSON (Expecting value: line 1 column 10 (char 9))"),
             "broken.yaml": ("seed: [1", "not YAML"),
             "deep.json": ('{"seed": ' + "[" * 200_000 + "]" * 200_000 + "}",
                           "nested too deeply to read"),
             "deep.yaml": ("seed: " + "[" * 5_000 + "]" * 5_000,
                           "nested too deeply to read"),  # it printed 2,999 lines
             "missing.json": (None, "cannot be read (No such file or directory)")}
    for name, (text, expected) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        for module, prog in ((config, "train.py"), (ev, "eval.py")):
            with pytest.raises(SystemExit) as e:
                module.parse_config(["--config", str(tmp_path / name)])
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and \
                err[0].startswith(f"{prog}: error: ") and str(tmp_path / name) in err[0] and \
                all(part in err[0] for part in expected.split(" | ")), (name, err)
    (tmp_path / "bench.json").write_text('{"benchmarks": "gsm8k"}')
    with pytest.raises(ValueError,
                       match="'benchmarks' must be a list of strings, not the text 'gsm8k'"):
        flags.read_config(ev.Config, str(tmp_path / "bench.json"))


def test_cli_misspelled_flags_are_named_and_abbreviations_refused(capsys):
    """A misspelled flag gets "did you mean" (it got only `unrecognized arguments: --stesp 3`) and a
    prefix of a flag is refused, with the flag it shortens named (`--ste 3` was taken for
    `--steps 3`), in train.py and eval.py."""
    for cls, argv, expected in (
            (config.Config, ["--stesp", "3"],
             "train.py: error: unrecognized arguments: --stesp 3 (did you mean --steps?)"),
            (config.Config, ["--ste", "3"],
             "train.py: error: unrecognized arguments: --ste 3 (did you mean --steps?)"),
            (config.Config, ["--lr", "1", "--temprature=0.5"],
             "train.py: error: unrecognized arguments: --temprature=0.5 (did you mean "
             "--temperature?)"),
            (config.Config, ["--zzz"], "train.py: error: unrecognized arguments: --zzz"),
            (ev.Config, ["--mod", "x"],
             "eval.py: error: unrecognized arguments: --mod x (did you mean --models?)")):
        with pytest.raises(SystemExit) as e:
            flags.parse_flags(cls, argv, "train.py" if cls is config.Config else "eval.py")
        assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [expected]
