"""model_files/gguf.py: the converted-GGUF cache, keyed by content and written into place.
"""
import importlib.util
import os
import shutil

import pytest

from model import tiny_model, tiny_tokenizer
from model_files import gguf


# ==================================================================================================
# model_files/gguf.py: the conversion cache
# ==================================================================================================
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="pip install gguf")
def test_model_gguf_cache_keyed_by_content(tmp_path, monkeypatch):
    """The converted-GGUF cache folder depends on the file's bytes and the converter's versions, not
    on where the file lies or when it was written: the copies two virtual environments install share
    one folder."""
    import transformers
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, copy, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", \
        tmp_path / "b" / "n.gguf"
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    shutil.copyfile(first, copy)
    os.utime(copy, (1_000_000, 1_000_000))  # another install time
    other.write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))  # same size, other bytes
    folder = gguf.gguf_cache_dir(str(first))
    assert folder == gguf.gguf_cache_dir(str(copy)) != \
        gguf.gguf_cache_dir(str(tmp_path / "b" / "n.gguf"))
    assert os.path.dirname(folder) == str(tmp_path / "cache")
    assert f"transformers{transformers.__version__}" in folder and \
        "gguf" in os.path.basename(folder)
    # rewritten in place: a new size/mtime, so hashed again
    first.write_bytes(b"GGUF" + bytes(256) * 64)
    os.utime(first, (2_000_000, 2_000_000))
    assert gguf.gguf_cache_dir(str(first)) != folder


def test_model_cache_folder_saved_into_place(tmp_path):
    """The cache folder appears whole by one rename; a writer that finds another's folder there
    leaves nothing."""
    lm, tokenizer = tiny_model(), tiny_tokenizer()
    folder = str(tmp_path / "converted")
    assert gguf._save_into_place(folder, lm, tokenizer)
    before = sorted(os.listdir(folder))
    assert "config.json" in before and "tokenizer.json" in before
    assert not gguf._save_into_place(folder, lm, tokenizer)  # a second writer loses the rename
    # no partial folder left
    assert os.listdir(tmp_path) == ["converted"] and sorted(os.listdir(folder)) == before
