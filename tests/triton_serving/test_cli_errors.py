"""Bad input through the CLI: one line naming what is wrong, non-zero exit, no traceback (no server needed)."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from optional import needs


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs("tritonclient")
@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("extra", [[], ["--model", "ensemble"]])
def test_infer_without_a_server_is_one_line(protocol, extra):
    url = f"127.0.0.1:{_closed_port()}"
    res = CliRunner().invoke(main, ["infer", "hello", "--url", url, "--protocol", protocol, *extra])
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{url}: "), res.output


def test_bench_without_a_server_is_one_line(monkeypatch):
    monkeypatch.setenv("TRTPIPE_AIPERF", "/bin/true")  # found; the server check comes first and fails
    url = f"127.0.0.1:{_closed_port()}"
    res = CliRunner().invoke(main, ["bench", "--url", url, "--tokenizer", "/tmp", "-n", "2", "-c", "1"])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"http://{url}: cannot reach the server"), res.output


def test_bench_without_aiperf_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTPIPE_AIPERF", str(tmp_path / "missing-aiperf"))
    res = CliRunner().invoke(main, ["bench", "--url", "127.0.0.1:1", "--tokenizer", "/tmp"])
    assert res.exit_code == 1
    assert res.output.strip() == f"TRTPIPE_AIPERF={tmp_path / 'missing-aiperf'}: no such file"


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["serve", "/nonexistent/repo"],
            "trtpipe serve: Invalid value for 'TARGET': Path '/nonexistent/repo' does not exist. (see trtpipe serve --help)",
        ),
        (
            ["inspect", "/nonexistent/x"],
            "trtpipe inspect: Invalid value for 'PATH': Directory '/nonexistent/x' does not exist. (see trtpipe inspect --help)",
        ),
        (["convert"], "trtpipe convert: Missing argument 'HF_DIR'. (see trtpipe convert --help)"),
        (["plan"], "trtpipe plan: RECIPE is required (or --list-gpus) (see trtpipe plan --help)"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args, message):
    res = CliRunner().invoke(main, args, prog_name="trtpipe")
    assert res.exit_code == 2
    assert res.stdout == "" and res.stderr == message + "\n"
