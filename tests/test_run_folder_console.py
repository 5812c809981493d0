"""run_folder/console.py: transformers' own progress bars kept off a run's console unless asked."""
from transformers.utils import logging

from model import tiny_model
from run_folder.console import quiet_library_bars


def test_transformers_bars_quiet_unless_asked(tmp_path, monkeypatch, capsys):
    """save_pretrained's "Writing model shards" (and from_pretrained's "Loading weights") drew
    bars between the run's lines; TRANSFORMERS_VERBOSITY=info brings them back."""
    monkeypatch.setattr(logging, "_tqdm_active", True)  # as on a terminal, whatever the suite set
    try:
        monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
        quiet_library_bars()
        tiny_model().save_pretrained(tmp_path / "a")
        assert "Writing model shards" not in capsys.readouterr().err
        logging.set_tqdm_hook(None)
        monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
        quiet_library_bars()
        tiny_model().save_pretrained(tmp_path / "b")
        assert "Writing model shards" in capsys.readouterr().err
    finally:
        logging.set_tqdm_hook(None)
