"""eval.py: its command line, end to end on a tiny model, --run and --regrade, one-line errors
(the benchmarks and the metrics: tests/test_evaluation_benchmarks.py and
test_evaluation_results.py)."""
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

import config
import eval as ev
import model
import reward
import rollout
import run_folder
import train
from data import builtin_task, load_rows
from engines import choice, plain_engine
from memory.estimate import kv_cache_bytes
from model import tiny_tokenizer
from rollout import INSTRUCTION, format_prompt
from tests.sampler_checks import REAL_VOCAB
from tests.toy_task import (EVEN, ROOT, TESTDATA, TOY_VOCAB, one_thread, patch_toy_task, toy_args,
                            toy_data)

# ==================================================================================================
# eval.py: the command line, end to end, --regrade
# ==================================================================================================
DATA = TESTDATA / "benchmarks"


def test_eval_cli_flags_and_help(capsys):
    cfg = ev.parse_config(["--models", "a", "lbl=b", "--benchmarks", "gsm8k", "--no-chat",
                           "--k", "8", "--preset", "justrl", "--max-new-tokens", "16"])
    assert cfg == ev.Config(models=["a", "lbl=b"], benchmarks=["gsm8k"], chat=False, k=8,
                            preset="justrl", max_new_tokens=16, temperature=0.7, top_p=0.9,
                            instruction=INSTRUCTION, seed=0, out="out/eval")
    assert ev.parse_config([]) == ev.Config(temperature=1.0, top_p=1.0, instruction=INSTRUCTION,
                                            seed=0, out="out/eval")
    # a flag beats the preset
    assert ev.parse_config(["--preset", "justrl", "--temperature", "0.5"]).top_p == 0.9
    # no instruction, not the default one
    assert ev.parse_config(["--instruction", ""]).instruction == ""
    with pytest.raises(SystemExit):
        ev.parse_config(["--preset", "greedy"])
    with pytest.raises(SystemExit):
        ev.parse_config(["--help"])
    assert "temperature 0.7, top-p 0.9" in capsys.readouterr().out


def _run_tiny(out, extra=()):
    return ev.main(["--models", "tiny", "--benchmarks", "gsm8k", "math500", "--data-dir", str(DATA),
                    "--limit", "3", "--k", "2", "--max-new-tokens", "6", "--batch-size", "4",
                    "--out", str(out), *extra])


def test_eval_end_to_end_tiny_and_regrade(tmp_path):
    _run_tiny(tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["k"] == 2 and results["config"]["models"] == ["tiny"]
    benches = results["models"]["tiny"]["benchmarks"]
    assert list(benches) == ["gsm8k", "math500"]
    golds = {b: [r["gold"] for r in ev.load_benchmark(b, DATA)[:3]] for b in benches}
    for b, bench in benches.items():
        assert (bench["k"], bench["temperature"], bench["top_p"]) == (2, 1.0, 1.0)
        assert [p["index"] for p in bench["problems"]] == [0, 1, 2]
        assert [p["gold"] for p in bench["problems"]] == golds[b]
        for p in bench["problems"]:
            assert len(p["samples"]) == 2
            for s in p["samples"]:
                assert set(s) == {"text", "extracted", "correct", "length", "truncated"}
                assert 1 <= s["length"] <= 6 and (not s["truncated"] or s["length"] == 6)
        assert bench["metrics"]["problems"] == 3 and bench["metrics"]["k"] == 2
    table = (tmp_path / "table.md").read_text()
    assert "| Model | MATH500 | GSM8K | Avg |" in table  # paper order, GSM8K last
    assert table.count("| tiny |") == 3  # one summary row, two detail rows

    # re-grade: make one sample of MATH500 problem 0 right -> avg@2 = 100 * (1/2) / 3
    benches["math500"]["problems"][0]["samples"][0]["text"] = f"so \\boxed{{{golds['math500'][0]}}}"
    (tmp_path / "results.json").write_text(json.dumps(results))
    ev.main(["--regrade", str(tmp_path / "results.json")])
    regraded = json.loads(
        (tmp_path / "results.json").read_text())["models"]["tiny"]["benchmarks"]["math500"]
    assert regraded["problems"][0]["samples"][0]["correct"] is True
    assert regraded["metrics"]["avg@k"] == pytest.approx(100 / 6)
    assert regraded["metrics"]["pass@k"] == pytest.approx(100 / 3)
    summary = next(line for line in (tmp_path / "table.md").read_text().splitlines()
                   if line.startswith("| tiny |"))
    cells = [c.strip() for c in summary.split("|")[1:-1]]
    assert cells[1] == cells[3] == "16.67"  # table.md rewritten: MATH500 and Avg (= MATH500 only)


def _results(**change) -> dict:
    """A minimal results.json as eval.py writes it: one model, one benchmark, one problem with one
    sample."""
    sample = {"text": "so \\boxed{2}", "extracted": None, "correct": False, "length": 3,
              "truncated": False}
    results = {"config": {"chat": True, "instruction": "", "run": None, "temperature": 1.0,
                          "top_p": 1.0, "max_new_tokens": 4},
               "models": {"m": {"name": "m", "benchmarks": {"gsm8k": {
                   "k": 1, "temperature": 1.0, "top_p": 1.0, "metrics": {},
                   "problems": [{"index": 0, "problem": "1+1?", "gold": "2",
                                 "samples": [sample]}]}}}}}
    return {**results, **change}


def test_eval_regrade_refuses_what_is_not_a_results_file_and_rewrites_nothing(tmp_path, capsys):
    """--regrade on a JSON list, on results without samples or without `config`: one line, exit 2,
    and the file is left as it was (it was rewritten before the failure, or the failure was a
    traceback)."""
    path = tmp_path / "results.json"
    no_samples = _results()
    no_samples["models"]["m"]["benchmarks"]["gsm8k"]["problems"][0]["samples"] = []
    cases = {"[1, 2]": "not an eval.py results.json (a list)",
             json.dumps({"models": _results()["models"]}):
                 "not an eval.py results.json (without 'config' and 'models')",
             json.dumps(_results(config={"chat": True})):
                 "its config lacks instruction, run, temperature",
             json.dumps(no_samples): "model m, benchmark gsm8k has no samples to grade",
             json.dumps(_results(models={"m": {"name": "m", "benchmarks": {}}})):
                 "model m has no samples to grade",
             "{not json": "not JSON"}
    for text, expected in cases.items():
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            ev.main(["--regrade", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 \
            and err[0].startswith(f"eval.py: error: --regrade {path}: ") \
            and expected in err[0], (expected, err)
        assert path.read_text() == text and not (tmp_path / "table.md").exists()
    path.write_text(json.dumps(_results()))
    regraded = ev.main(["--regrade", str(path)])
    assert regraded["models"]["m"]["benchmarks"]["gsm8k"]["metrics"]["avg@k"] == 100.0
    assert json.loads(path.read_text()) == regraded and (tmp_path / "table.md").exists()


def test_eval_truncated_safetensors_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """A model folder whose .safetensors file was cut short (an interrupted copy): one line naming
    the file, exit status 2, before the model loads (it was a SafetensorError traceback from inside
    transformers)."""
    lm, tokenizer = model.load_model("tiny")
    lm.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", str(tmp_path / "hf"), "--benchmarks", "gsm8k", "--data-dir", str(DATA),
                 "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: {weights}: not a complete safetensors "
                                         f"file (Error while deserializing header: incomplete "
                                         f"metadata, file not fully covered); copy or export it "
                                         f"again"], err
    assert not (tmp_path / "e").exists()


def test_eval_kv_cache_budget_bounds_every_call(tmp_path, monkeypatch, capsys):
    """--kv-cache-gb bounds the rows of every generate call (at their longest) and the engine's KV
    cache, as in train.py. (eval.py gave vLLM --batch-size rows at full length: ~141 GiB for
    Qwen3-1.7B at k = 32 and 20k tokens, more than an H200 has.)"""
    made, calls = {}, []

    class Recording(plain_engine.PlainEngine):
        def sample(self, prompts, group_size, *args):
            calls.append(len(prompts) * group_size)
            return super().sample(prompts, group_size, *args)

    def make_engine(name, lm, tokenizer, chat, stop=None, **kwargs):
        made.update(kwargs, row=kv_cache_bytes(lm.config, 1, kwargs["max_model_len"], 4))
        return Recording(lm, rollout.eos_ids(lm, tokenizer, chat), tokenizer.pad_token_id,
                         REAL_VOCAB)

    monkeypatch.setattr(choice, "make_engine", make_engine)
    _run_tiny(tmp_path)  # --batch-size 4: 2 problems x k 2 per call
    assert calls == [4, 2] * 2 and made["kv_cache_memory_bytes"] == 4 * made["row"], calls
    calls.clear()
    budget = 3.5 * made["row"]  # bytes: 3 rows at the longest prompt + 6 new tokens
    _run_tiny(tmp_path, ["--kv-cache-gb", str(budget / 1e9), "--overwrite"])
    # 1 problem x k 2 per call
    assert calls == [2] * 6 and made["kv_cache_memory_bytes"] == 2 * made["row"] <= budget, calls
    assert "problems x samples per generate call: gsm8k 1 x 2, math500 1 x 2" \
        in capsys.readouterr().out


def test_eval_torchrun_two_ranks_gather_in_order(tmp_path):
    """2 processes (gloo): the problems are dealt to the ranks, gathered to rank 0 in the original
    order and sampled as 1 process samples them (with --batch-size 2: calls [0] on rank 0, [1] on
    rank 1, [2] on rank 0), and the process group is really torn down (its gloo threads once
    outlived destroy_process_group, because torch's FSDP was first imported after
    init_process_group, and aborted a rank at exit now and then)."""
    runner = tmp_path / "runner.py"
    runner.write_text(f"""import glob, sys
sys.path.insert(0, {str(ROOT)!r})
import eval
eval.main(sys.argv[1:])
threads = [open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")]
assert not any("gloo" in t for t in threads), threads
""")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(runner), "--models", "tiny", "--benchmarks", "amc23", "--data-dir", str(DATA),
           "--limit", "3", "--k", "2", "--max-new-tokens", "4", "--batch-size", "2",
           "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = json.loads(
        (tmp_path / "results.json").read_text())["models"]["tiny"]["benchmarks"]["amc23"]
    assert [p["index"] for p in bench["problems"]] == [0, 1, 2]
    assert [p["gold"] for p in bench["problems"]] == ["55.0", "24.0", "12.0"]
    assert all(len(p["samples"]) == 2 for p in bench["problems"])
    # the same samples on 1 process (each call seeded by its first problem, not by the rank)
    with one_thread():
        one = ev.main(cmd[cmd.index("--models"):-1]
                      + [str(tmp_path / "one")])["models"]["tiny"]["benchmarks"]["amc23"]
    assert [[s["text"] for s in p["samples"]] for p in one["problems"]] == \
        [[s["text"] for s in p["samples"]] for p in bench["problems"]]

def _tiny_run(folder: Path, **values) -> Path:
    """A train.py output folder: config.json (config.Config + `values`) and an hf/ export of the
    tiny model."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(asdict(config.Config(**values))))
    lm, tokenizer = model.load_model("tiny")
    lm.save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    return folder


def _record_sampling(monkeypatch) -> list[dict]:
    """Wrap rollout.sample_groups where the plain engine calls it (engines/plain_engine.py): each
    call's prompts and sampling arguments are appended to the returned list."""
    calls, sample = [], rollout.sample_groups

    def recorded(lm, prompts, k, sampling, **kw):
        calls.append({"prompts": prompts, "k": k, **{key: getattr(sampling, key) for key in (
            "temperature", "top_p", "max_new_tokens")}})
        return sample(lm, prompts, k, sampling, **kw)

    monkeypatch.setattr("engines.plain_engine.sample_groups", recorded)
    return calls


def _sums_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"q": {"text": f"What is {a} + 1?"}, "sol": [str(a + 1)]})
                            + "\n" for a in range(3)))
    return path


def test_eval_uses_the_training_runs_prompt_and_sampling(tmp_path, monkeypatch, capsys):
    """--run RUN (or --models RUN/hf) samples with the run's prompt format and sampling settings
    from its config.json; flags given still win; with no --benchmarks a built-in-task run is scored
    on its held-out set."""
    run = _tiny_run(tmp_path / "run", data="", chat=False, instruction="The answer is",
                    temperature=0.7, top_p=0.9, max_response_len=5, eval_samples=2)
    data = _sums_file(tmp_path / "sums.jsonl")
    tokenizer = tiny_tokenizer()
    problems = [f"What is {a} + 1?" for a in range(3)]
    calls = _record_sampling(monkeypatch)
    for how in (["--run", str(run)], ["--models", str(run / "hf")]):
        calls.clear()
        results = ev.main([*how, "--data", str(data), "--prompt-key", "q.text",
                           "--answer-key", "sol", "--k", "2", "--out", str(tmp_path / "out"),
                           "--overwrite"])
        expected = [format_prompt(tokenizer, p, False, "The answer is") for p in problems]
        assert [c["prompts"] for c in calls] == [expected]
        assert [(c["temperature"], c["top_p"], c["max_new_tokens"]) for c in calls] == \
            [(0.7, 0.9, 5)]
        config = results["config"]
        assert (config["run"], config["chat"], config["instruction"]) == \
            (str(run), False, "The answer is")
        assert ("temperature 0.7, top-p 0.9, max 5 new tokens, raw text + instruction "
                "'The answer is'") in (tmp_path / "out" / "table.md").read_text()
        assert f"prompts and sampling of the run {run}" in capsys.readouterr().out
    calls.clear()
    ev.main(["--run", str(run), "--data", str(data), "--prompt-key", "q.text",
             "--answer-key", "sol", "--chat", "--instruction", "Go.", "--temperature", "1.0",
             "--max-new-tokens", "3", "--out", str(tmp_path / "o2")])
    assert calls[0]["prompts"] == [format_prompt(tokenizer, p, True, "Go.") for p in problems]
    assert (calls[0]["temperature"], calls[0]["top_p"], calls[0]["max_new_tokens"]) == (1.0, 0.9, 3)
    calls.clear()
    results = ev.main(["--run", str(run), "--limit", "3", "--out", str(tmp_path / "o3")])
    heldout = results["models"][str(run / "hf")]["benchmarks"]["heldout"]
    assert [p["problem"] for p in heldout["problems"]] == \
        [r["problem"] for r in builtin_task("test")[:3]]
    assert heldout["k"] == 2 and calls[0]["k"] == 2  # the run's --eval-samples


def test_eval_run_on_your_own_data_with_the_default_heldout(tmp_path, monkeypatch):
    """A run on your own --data records the default `"heldout": null` (a tenth of the rows); eval.py
    --run scores that run's held-out rows, and --models RUN/hf --data FILE your file. (Both ended in
    "TypeError: '>' not supported between instances of 'NoneType' and 'int'".)"""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
                            + "\n" for a in range(6) for b in range(5)))  # 30 rows: 3 held out
    run = _tiny_run(tmp_path / "run", data=str(data), prompt_key="prompt", answer_key="answer",
                    chat=False, max_response_len=2, eval_samples=2)
    assert json.loads((run / "config.json").read_text())["heldout"] is None
    with one_thread():
        results = ev.main(["--run", str(run)])
        heldout = results["models"][str(run / "hf")]["benchmarks"]["heldout"]
        expected = load_rows(SimpleNamespace(**json.loads((run / "config.json").read_text())))[1]
        assert [p["problem"] for p in heldout["problems"]] == [r["problem"] for r in expected] \
            and len(expected) == 3
        results = ev.main(["--models", str(run / "hf"), "--data", str(data), "--limit", "2",
                           "--out", str(tmp_path / "own")])
    assert list(results["models"][str(run / "hf")]["benchmarks"]) == ["rows"]


def test_eval_own_jsonl_with_named_fields(tmp_path):
    """--data FILE (NAME=FILE) with --prompt-key/--answer-key: train.py's field rules (dotted paths,
    answer lists, chat message lists); each file is a column of the table, never part of Avg; every
    sample graded by reward.grade."""
    sums = _sums_file(tmp_path / "sums.jsonl")
    (tmp_path / "chat.jsonl").write_text(json.dumps(
        {"q": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is 2 + 2?"}], "sol": "4"}) + "\n")
    # the chat file has no q.text: one line error naming the file and row
    with pytest.raises(SystemExit):
        ev.main(["--models", "tiny", "--data", str(sums), f"talk={tmp_path / 'chat.jsonl'}",
                 "--prompt-key", "q.text", "--answer-key", "sol", "--out", str(tmp_path / "out")])
    results = ev.main(["--models", "tiny", "--data", str(sums), "--prompt-key", "q.text",
                       "--answer-key", "sol", "--no-chat", "--k", "2", "--max-new-tokens", "3",
                       "--out", str(tmp_path / "out")])
    bench = results["models"]["tiny"]["benchmarks"]["sums"]
    assert [(p["problem"], p["gold"]) for p in bench["problems"]] == \
        [(f"What is {a} + 1?", [str(a + 1)]) for a in range(3)]
    for p in bench["problems"]:
        assert len(p["samples"]) == 2
        assert all(s["correct"] == reward.grade(s["text"], p["gold"]) for s in p["samples"])
    table = (tmp_path / "out" / "table.md").read_text()
    # no paper benchmark: no Avg column, no "Avg = mean over the 0 of the paper's six benchmarks"
    assert "| Model | sums |\n" in table and "| tiny | sums | 3 | 2 |" in table \
        and "Avg" not in table
    results = ev.main(["--models", "tiny", "--data", f"talk={tmp_path / 'chat.jsonl'}",
                       "--prompt-key", "q", "--answer-key", "sol", "--k", "1",
                       "--max-new-tokens", "2", "--out", str(tmp_path / "o2")])
    assert results["models"]["tiny"]["benchmarks"]["talk"]["problems"][0]["problem"] == \
        "What is 2 + 2?"


def test_eval_bad_inputs_one_line_error_before_any_model(tmp_path, monkeypatch, capsys):
    """Wrong --data-dir, a missing benchmark file, a wrong model path, an unknown benchmark, ...:
    one line on stderr, exit status 2, no model loaded, nothing written."""
    data = _sums_file(tmp_path / "sums.jsonl")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    cases = {
        "--data-dir": ["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "nope")],
        f"benchmark gsm8k: {tmp_path / 'empty' / 'gsm8k.jsonl'} not found":
            ["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "empty")],
        "model directory not found: ./no/such/model":
            ["--models", "tiny", "./no/such/model", "--data", str(data), "--prompt-key", "q.text",
             "--answer-key", "sol"],
        "unknown benchmark 'easy'": ["--benchmarks", "easy", "--data-dir", str(tmp_path)],
        "not a train.py output folder": ["--run", str(tmp_path / "empty")],
        "data file not found": ["--data", str(tmp_path / "missing.jsonl")],
        "sums.jsonl line 1: no prompt in field 'problem' (the row's fields: q, sol); name the "
        "field with --prompt-key": ["--data", str(data)],
        "give --run": ["--benchmarks", "heldout"],
        "--temperature 0.0 is out of range": ["--data", str(data), "--temperature", "0"],
    }
    import model as model_lib
    monkeypatch.setattr(model_lib, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for expected, args in cases.items():
        with pytest.raises(SystemExit) as e:
            ev.main(args + ["--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("eval.py: error:") \
            and expected in err[0], (expected, err)
        assert not out.exists()
    with pytest.raises(SystemExit) as e:  # it wrote into the working directory
        ev.main(["--data", str(data), "--prompt-key", "q.text", "--answer-key", "sol", "--out", ""])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "eval.py: error: --out '' names no folder: give one, e.g. --out out/eval"]
    proc = subprocess.run([sys.executable, "eval.py", *cases["--data-dir"], "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"eval.py: error: --data-dir {tmp_path / 'nope'}: no such folder"] and not out.exists()


# --------------------------------------------------------------- eval.py on a training run's folder

def test_eval_model_folder_without_weights_or_config_is_one_line(tmp_path, capsys):
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    for folder, expected in (("noconfig", "has no config.json"), ("noweights", "has no weights")):
        with pytest.raises(SystemExit) as e:
            ev.main(["--models", str(tmp_path / folder), "--benchmarks", "gsm8k",
                     "--data-dir", str(DATA), "--out", str(tmp_path / "e")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and expected in err[0], err


def test_eval_run_reproduces_train_heldout_evaluation(tmp_path, monkeypatch, capsys):
    """eval.py --run on a finished run, with default flags, samples the held-out problems as
    train.py's evaluation did (seed + 1, one generate call per problem, seeded by the problem), so
    it reports the same accuracy and mean length as the run's last eval.jsonl line; it writes into
    RUN/eval/step_N (N: the export's step) and refuses to replace an earlier evaluation there
    without --overwrite. (It printed 11.25 for a run whose eval.jsonl said 8.75, unless given
    --seed 1 --batch-size 80, and wrote every evaluation into the same out/eval.)"""
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", heldout=17, steps=2)) == 0
    last = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert len(last["eval/correct"]) == 17 \
        and sum(last["eval/correct"]) == last["eval/acc"] * last["eval/n"]
    # as train.py's was in this run
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    results = ev.main(["--run", str(tmp_path / "run")])
    bench = results["models"][str(tmp_path / "run" / "hf")]["benchmarks"]["heldout"]
    assert last["step"] == 2 and bench["k"] == 4 and len(bench["problems"]) == 17
    assert bench["metrics"]["avg@k"] == pytest.approx(100 * last["eval/acc"])
    assert bench["metrics"]["mean_length"] == pytest.approx(last["eval/len_mean"])
    out = tmp_path / "run" / "eval" / "step_2"
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(tmp_path / "run"), "--k", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: --out {out} holds the results of an "
                                         f"earlier evaluation (results.json): choose another "
                                         f"--out, or replace them with --overwrite"], err
    ev.main(["--run", str(tmp_path / "run"), "--k", "1", "--limit", "2", "--overwrite"])
    assert json.loads((out / "results.json").read_text())["config"]["k"] == 1


def test_eval_of_a_run_without_export_names_the_export_command_and_results_name_the_export(
        tmp_path, monkeypatch, capsys):
    """eval.py --run on a run made with --no-export-hf names the command that exports it, and that
    command exports without training and without the AdamW-restart warning; results.json and
    table.md name the step and checksum of the export they scored, and a newer export (after a
    resume) is evaluated into a folder of its own. (The refusal named no command, the command warned
    that AdamW restarts, and a step-3 evaluation sat beside a step-5 export, refusing the new
    one.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        # no export
        assert train.main(toy_args(toy_data(tmp_path), run, heldout=2, steps=2, light=True)) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(run)])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"eval.py: error: --run: {run / 'hf'} not found (train.py writes it at the end unless "
        f"--no-export-hf); export its checkpoint after 2 steps with: python train.py --resume "
        f"{run} --export-hf"]
    # a run stopped early
    assert ev.export_command(run, {"steps": 5}) == (f"export its checkpoint after 2 steps with: "
                                                    f"python train.py --resume {run} --steps 2 "
                                                    f"--export-hf")
    assert (run / "checkpoint" / "step_2").is_dir() and not (run / "hf").exists()
    # weights only: no AdamW moments
    assert json.loads((run / "checkpoint" / "step_2" / "manifest.json").read_text())[
        "files"].keys() == {".metadata", "__0_0.distcp", "state.pt"}
    metrics = (run / "metrics.jsonl").read_text()
    with one_thread():
        assert train.main(["--resume", str(run), "--export-hf"]) == 0
    out, err = capsys.readouterr()
    assert "AdamW" not in err \
        and f"{run / 'checkpoint' / 'step_2'}: all 2 steps done, nothing to train" in out, err
    assert (run / "metrics.jsonl").read_text() == metrics \
        and run_folder.export_step(run / "hf") == 2
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    results = ev.main(["--run", str(run), "--k", "1"])
    export = run_folder.export_id(run / "hf")
    assert results["models"][str(run / "hf")]["export"] == export and export["step"] == 2
    assert len(export["checksum"]) == 8
    assert f"{run / 'hf'} is the export after 2 steps (checksum {export['checksum']})." in \
        (run / "eval" / "step_2" / "table.md").read_text()
    with one_thread():
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
    # the newer export: its own folder, the earlier one kept
    results = ev.main(["--run", str(run), "--k", "1"])
    assert results["models"][str(run / "hf")]["export"]["step"] == 3
    assert [json.loads((run / "eval" / f"step_{n}" / "results.json").read_text())["models"][
        str(run / "hf")]["export"]["step"] for n in (2, 3)] == [2, 3]


class _TornWrite:
    """A file on a full disk: a write keeps half of its data, then raises ENOSPC."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_eval_full_disk_a_training_run_and_ctrl_c_are_one_line(tmp_path, monkeypatch, capsys):
    """A full disk in results.json: one line naming it and the fix, no torn file left, so the same
    command then evaluates and --regrade reads it. eval.py --run takes the run folder's lock
    (shared): refused in one line while train.py writes there, and train.py --overwrite refused
    while it evaluates. Ctrl-C: one line naming what results.json holds, exit 130. (A torn
    results.json then blocked a rerun and was "not JSON" to --regrade; an evaluation raced by
    --overwrite saved the old model's results in the new run; Ctrl-C printed a 30-71 line
    traceback.)"""
    import builtins
    import io

    real_open = io.open

    def full_disk(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return _TornWrite(f) if Path(path).name.startswith("results.json") and "w" in mode else f

    out = tmp_path / "e"
    monkeypatch.setattr(io, "open", full_disk)
    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(SystemExit) as e:
        _run_tiny(out)
    monkeypatch.setattr(io, "open", real_open)
    monkeypatch.setattr(builtins, "open", real_open)
    err = capsys.readouterr().err
    assert e.value.code == 2 and [x for x in err.splitlines() if "eval.py" in x] == [
        f"eval.py: error: could not write {out / 'results.json'} (No space left on device): free "
        f"space on its disk, then run the same command again"] and "Traceback" not in err, err
    assert not [p.name for p in out.iterdir() if p.name.startswith("results.json")]
    _run_tiny(out)
    assert ev.main(["--regrade", str(out / "results.json")])["models"]["tiny"]

    patch_toy_task(monkeypatch, EVEN)
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    run, data = tmp_path / "run", toy_data(tmp_path)
    with one_thread():
        assert train.main(toy_args(data, run, heldout=2, steps=1)) == 0
    training = run_folder.Lock(run)  # train.py writing into the run
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(
        f"eval.py: error: {run} is being written by a training run (host ") and err[0].endswith(
        "): evaluate it when that run has ended, or stop it"), err
    training.release()
    evaluating = run_folder.Lock(run, reader="eval.py")  # eval.py --run evaluating it
    assert train.main(toy_args(data, run, heldout=2, steps=1, overwrite=True)) == 2
    err = capsys.readouterr().err
    assert f"train.py: error: {run} is in use by another run (eval.py host " in err, err
    evaluating.release()
    assert json.loads((run / "hf" / "export.json").read_text())["step"] == 1  # untouched

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plain_engine.PlainEngine, "sample", interrupted)
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.strip().splitlines()[-1] == (
        "eval.py: interrupted (SIGINT): nothing was written") and "Traceback" not in err, err
    run_folder.Lock(run).release()  # the lock went with it
