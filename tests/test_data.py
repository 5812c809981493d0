"""data.py: reading your own files (errors that name the line, the fields and the flag, repeated
rows), without the `datasets` package for a .jsonl file.
"""
import json
import subprocess
import sys

import pytest

import eval as ev
import model
from data import answer_value, read_rows, repeated_note
from tests.toy_task import ROOT


@pytest.mark.parametrize("answer, expected", [
    ({"x": 1}, "the answer is a JSON object"), (True, "the answer is a boolean"),
    (float("nan"), "the answer is nan, not a finite number"),
    ([1, 2], "a list that is not all non-empty strings"),
    ("\ud800", "the answer holds the lone surrogate '\\ud800' at character 1")])
def test_eval_data_readers_refuse_answers_that_are_not_answers(tmp_path, answer, expected):
    """An answer is a string, a finite number or a list of strings: a JSON object (its keys became
    the answer), a boolean ("True"), NaN ("nan"), a list of numbers and a lone surrogate are one
    error naming the 1-based line, in --data files (read_rows) and benchmark files (load_benchmark)
    alike."""
    lines = [json.dumps({"problem": "1+1?", "answer": "2"}), "",
             json.dumps({"problem": "2+2?", "answer": answer})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        read_rows(str(tmp_path / "d.jsonl"), "problem", "answer")
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'} line 3: ") and \
        expected in str(e.value), str(e.value)
    (tmp_path / "aime24.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        ev.load_benchmark("aime24", tmp_path)
    assert f"line 3 of {tmp_path / 'aime24.jsonl'}: " in str(e.value) and \
        expected in str(e.value), str(e.value)
    assert answer_value(27.0) == "27.0" and answer_value(["1", "2"]) == ["1", "2"] and \
        answer_value("x") == "x"


def test_eval_data_errors_name_fields_lines_and_count_duplicates(tmp_path, monkeypatch, capsys):
    """Without --prompt-key the error names the row's fields and the flag; a prompt with a lone
    surrogate (valid JSON, not UTF-8: it failed only in the tokenizer, after the model loaded) is an
    error naming its line before any model loads; a repeated row is dropped and counted on stderr,
    like prompts over --max-prompt-len."""
    path = tmp_path / "easy.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"easy.jsonl line 1: no prompt in field 'prompt' \(the "
                                         r"row's fields: q, a\); name the field with --prompt-key"):
        read_rows(str(path), "prompt", "a")
    with pytest.raises(ValueError, match=r"line 1: no answer in field 'answer' \(the row's fields: "
                                         r"q, a\); name the field with --answer-key"):
        read_rows(str(path), "q", "answer")
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n" + '{"q": "2+\\ud800?", "a": "4"}\n')
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", "tiny", "--data", str(path), "--prompt-key", "q", "--answer-key", "a",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [
        f"eval.py: error: {path} line 2: the prompt holds the lone surrogate '\\ud800' at "
        f"character 3, which is not UTF-8 text"], err
    path.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in
                            (("1+1?", "2"), ("2+2?", "4"), ("1+1?", "2"), ("1+1?", 2),
                             ("1+1?", "3"))))
    assert read_rows(str(path), "q", "a") == ([
        {"problem": "1+1?", "answer": "2", "fields": {"q": "1+1?", "a": "2"}},
        {"problem": "2+2?", "answer": "4", "fields": {"q": "2+2?", "a": "4"}},
        {"problem": "1+1?", "answer": "3", "fields": {"q": "1+1?", "a": "3"}}], 2)
    assert repeated_note(str(path), 2, 3) == (f"{path}: dropped 2 of 5 rows that repeat an earlier "
                                              f"row's problem and answer; 3 rows remain")
    assert repeated_note("d", 1, 1).endswith("answer; 1 row remains")  # it said "1 rows remain"


def test_read_rows_of_a_jsonl_file_needs_no_datasets(tmp_path):
    """A .jsonl --data file is read without the `datasets` package (the GPU check runs where it is
    not installed): with `import datasets` failing, the rows still come back."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    code = ("import sys; sys.modules['datasets'] = None; from data import read_rows; "
            f"print(read_rows({str(path)!r}, 'q', 'a'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == (
        "([{'problem': '1+1?', 'answer': '2', 'fields': {'q': '1+1?', 'a': '2'}}], 0)"), done.stderr
