"""The pipeline's parts on their own: the stage table, progress bars, versions, lock, atomic writes."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch

from trtpipe.pipeline.cache import BuildLockedError, WorkDirLock, atomic_write_json
from trtpipe.pipeline.progress import progress_bar
from trtpipe.pipeline.stage import Stage
from trtpipe.app.stage_table import STAGE_NAMES, STAGE_TABLE
from trtpipe.pipeline.versions import collect_versions, parse_nvidia_smi, torch_cuda_version


def test_stage_table_rows_are_stages_named_as_their_row_in_build_order():
    assert [name for name, _ in STAGE_TABLE] == list(STAGE_NAMES)
    for name, stage in STAGE_TABLE:
        assert isinstance(stage, Stage) and stage.name == name
        # every input a stage reads comes earlier in the table
        assert set(stage.inputs) <= set(STAGE_NAMES[: STAGE_NAMES.index(name)])


def test_progress_bar_draws_on_stderr_only_when_enabled(capfd):
    with progress_bar("working", total=3) as bar:
        for _ in range(3):
            bar.advance()
    out, err = capfd.readouterr()
    assert out == "" and "working" in err and "3/3" in err
    with progress_bar("quiet", total=2, disabled=True) as bar:
        bar.advance(2)
        bar.update(total=4, description="relabelled")
    assert capfd.readouterr() == ("", "") and (bar.completed, bar.total) == (2, 4)


def test_progress_bar_with_a_unit_starts_from_what_is_done_and_shows_a_rate(capfd):
    with progress_bar("batch", total=10, unit="req", completed=4) as bar:  # a resumed job: 4 done before
        bar.advance()
        bar.advance()
    err = capfd.readouterr().err
    assert "6/10" in err and "req/s" in err and bar.completed == 6


def test_versions_of_this_machine():
    versions = collect_versions()
    assert versions["python"] == platform.python_version()
    assert versions["torch"] == torch.__version__
    assert versions["cuda"] == torch.version.cuda == torch_cuda_version()
    import transformers

    assert versions["transformers"] == transformers.__version__
    if shutil.which("nvidia-smi") is None:  # a CPU machine: GPU facts are absent, not guessed
        assert (versions["driver"], versions["gpu_compute_capability"], versions["gpus"]) == (None, None, [])
    else:
        assert versions["gpus"] and versions["gpu_compute_capability"]


def test_nvidia_smi_csv_rows_are_parsed():
    # The row format of `nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader`.
    rows = "NVIDIA H100 80GB HBM3, 550.54.15, 9.0, 81559 MiB\nNVIDIA H100 80GB HBM3, 550.54.15, 9.0, 81559 MiB\n"
    gpus = parse_nvidia_smi(rows)
    assert len(gpus) == 2
    assert gpus[0] == {
        "name": "NVIDIA H100 80GB HBM3",
        "driver": "550.54.15",
        "compute_capability": "9.0",
        "memory_total": "81559 MiB",
    }
    assert parse_nvidia_smi("") == []


def test_work_dir_lock_is_exclusive_and_released(tmp_path):
    with WorkDirLock(tmp_path):
        with pytest.raises(BuildLockedError, match=f"another build is running here \\(pid {os.getpid()} since"):
            WorkDirLock(tmp_path).__enter__()
    with WorkDirLock(tmp_path):  # released on exit
        pass


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "m.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"b": 2})
    assert target.read_text() == '{\n  "b": 2\n}\n'
    assert [p.name for p in target.parent.iterdir()] == ["m.json"]
