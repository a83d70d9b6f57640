"""Inputs the build refuses before reading them as a model (issue 38): a NaN or infinite value in config.json,
named by its key, and a FIFO (or device) where the build reads a file, named by its path, with no read that
blocks."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from trtpipe.errors import CheckpointError
from trtpipe.models.dims import read_hf_config

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


def model_dir(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


@pytest.mark.parametrize(
    "text, key, shown",
    [
        (json.dumps({**CONFIG, "rms_norm_eps": float("nan")}), "rms_norm_eps", "NaN"),  # Python writes NaN
        (json.dumps(CONFIG).replace("1e-05", "Infinity"), "rms_norm_eps", "Infinity"),
        (json.dumps(CONFIG).replace("1e-05", "1e999"), "rms_norm_eps", "Infinity"),  # overflows to inf
        (json.dumps({**CONFIG, "rope_scaling": {"factor": float("-inf")}}), "rope_scaling.factor", "-Infinity"),
    ],
)
def test_a_nan_or_infinite_config_value_is_refused_naming_the_key(tmp_path, text, key, shown):
    d = model_dir(tmp_path, text)
    with pytest.raises(CheckpointError) as err:
        read_hf_config(d)
    assert str(err.value) == f"{d / 'config.json'}: key '{key}': {shown} is not a finite number"


def test_a_finite_config_reads(tmp_path):
    assert read_hf_config(model_dir(tmp_path, json.dumps(CONFIG))).rms_norm_eps == 1e-5


def _release(fifo: Path, writer: threading.Thread) -> None:
    """Let a writer blocked in open() go (open the read end), whichever code ran."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer.join(10)
    os.close(fd)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_fifo_in_the_model_directory_is_refused_without_reading_it(tmp_path, name):
    d = model_dir(tmp_path, json.dumps(CONFIG))
    fifo = d / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    # an old reader would block in open(): a writer that sends EOF makes it end (and fail this test) instead
    writer = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        with pytest.raises(CheckpointError) as err:
            read_hf_config(d)
        assert str(err.value) == f"{fifo}: is a FIFO, not a regular file (reading it would block or never end)"
    finally:
        _release(fifo, writer)


def test_a_fifo_safetensors_shard_is_refused(tmp_path):
    from trtpipe.checkpoint.hf import SafetensorsFile

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        with pytest.raises(CheckpointError, match=r"model.safetensors: is a FIFO, not a regular file"):
            SafetensorsFile(fifo)
    finally:
        _release(fifo, writer)


def test_a_device_is_refused(tmp_path):
    from trtpipe.checkpoint.hf import SafetensorsFile

    if not Path("/dev/null").is_char_device():
        pytest.skip("no /dev/null")
    with pytest.raises(CheckpointError, match=r"/dev/null: is a character device, not a regular file"):
        SafetensorsFile(Path("/dev/null"))
