"""Bad input: a one-line CheckpointError naming the tensor or key, and nothing left at the output path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtpipe.checkpoint.convert import convert
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import make_synthetic
from trtpipe.runtime import load_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_synthetic("llama", tmp_path_factory.mktemp("base") / "hf", num_hidden_layers=2)


@pytest.fixture
def model(base, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(base, d)
    return d


def _edit(model_dir, fn):
    path = model_dir / "model.safetensors"
    state = load_file(path)
    fn(state)
    save_file(state, path, metadata={"format": "pt"})


def _fails(model_dir, out, match, **kw):
    with pytest.raises(CheckpointError) as err:
        convert(model_dir, out, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    assert match in msg, msg
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")] == []
    return msg


def test_missing_tensor(model, tmp_path):
    _edit(model, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    _fails(model, tmp_path / "out", "'model.layers.1.mlp.up_proj.weight' is missing")


def test_extra_tensor(model, tmp_path):
    _edit(model, lambda s: s.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)))
    _fails(
        model, tmp_path / "out", "'model.layers.0.self_attn.extra.weight' is not part of the LlamaForCausalLM mapping"
    )


def test_layer_beyond_config_is_extra(model, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (model / "config.json").write_text(json.dumps(cfg))
    _fails(model, tmp_path / "out", "'model.layers.1.")


def test_shape_contradicting_config(model, tmp_path):
    _edit(model, lambda s: s.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64)))
    _fails(
        model,
        tmp_path / "out",
        "'model.layers.0.self_attn.k_proj.weight' has shape [32, 64] but config.json implies [64, 64]",
    )


@pytest.mark.parametrize("value,word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_weight(model, tmp_path, value, word):
    def poison(s):
        s["model.layers.1.self_attn.o_proj.weight"][3, 5] = value

    _edit(model, poison)
    _fails(model, tmp_path / "out", f"'model.layers.1.self_attn.o_proj.weight' contains {word}")


def test_truncated_file(model, tmp_path):
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    msg = _fails(model, tmp_path / "out", "truncated")
    assert "model.safetensors" in msg and "tensor '" in msg


def test_heads_not_divisible_by_tp(model, tmp_path):
    _fails(model, tmp_path / "out", "num_attention_heads=4 is not divisible by tp=3", tp=3)


def test_unknown_architecture(model, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    _fails(model, tmp_path / "out", "'GPT2LMHeadModel' is not supported")


def test_non_empty_output_is_not_overwritten(model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        convert(model, out)
    assert (out / "keep.txt").exists()


def test_pickle_refused_unless_allowed(model, tmp_path):
    state = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save(state, model / "pytorch_model.bin")
    _fails(model, tmp_path / "out", "pickle checkpoints can run code")
    ckpt = convert(model, tmp_path / "ok", allow_pickle=True, dtype="float32")
    assert load_checkpoint(ckpt)(torch.tensor([[1, 2, 3]])).shape == (1, 3, 250)


def test_pickle_with_code_is_refused_even_when_allowed(model, tmp_path):
    import pickle

    (model / "model.safetensors").unlink()

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(model / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    _fails(model, tmp_path / "out", "weights_only=True", allow_pickle=True)


@pytest.mark.parametrize(
    "header,match",
    [
        (b"[1, 2, 3]", "invalid safetensors header: a JSON list, not an object"),
        (
            b'{"model.embed_tokens.weight": 5}',
            "invalid safetensors header: tensor 'model.embed_tokens.weight' is not an object",
        ),
        (
            b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [2]}}',
            "invalid safetensors header: tensor 'model.embed_tokens.weight' needs an integer shape and data_offsets",
        ),
    ],
)
def test_malformed_safetensors_header(model, tmp_path, header, match):
    import struct

    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    msg = _fails(model, tmp_path / "out", match)
    assert msg.startswith(f"{model / 'model.safetensors'}: ")


def _two_tensors(path, edit):
    """A safetensors file of two 4-byte tensors (a at [0, 4), b at [4, 8)) whose header ``edit`` changes, checked
    first against the safetensors library: what it refuses, the reader refuses."""
    import struct

    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    header["b"] = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}
    data = edit(header)
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + data
    with pytest.raises(SafetensorError):
        st_load(blob)
    path.write_bytes(blob)


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda h: (h["a"].update(data_offsets=[-8, -4]), bytes(8))[1],
            r"tensor 'a' has data_offsets \[-8, -4\]",  # the header's last bytes read as weights
        ),
        (lambda h: (h["b"].update(data_offsets=[8, 4]), bytes(8))[1], r"tensor 'b' has data_offsets \[8, 4\]"),
        (
            lambda h: (h["b"].update(data_offsets=[0, 4]), bytes(8))[1],
            r"tensor 'b' data_offsets begin at 0, which overlaps",
        ),
        (
            lambda h: (h["b"].update(data_offsets=[8, 12]), bytes(12))[1],
            r"tensor 'b' data_offsets begin at 8, which leaves a gap",
        ),
        (lambda h: bytes(12), r"the tensors cover 8 of the 12 data bytes"),
        (
            lambda h: (h["a"].update(shape=[-1, -1]), bytes(8))[1],
            r"tensor 'a' has data_offsets \[0, 4\] and shape \[-1, -1\]",
        ),
    ],
)
def test_safetensors_data_offsets_checked_as_the_library_checks_them(model, tmp_path, edit, match):
    from trtpipe.checkpoint.hf import SafetensorsFile

    path = tmp_path / "x.safetensors"
    _two_tensors(path, edit)
    with pytest.raises(CheckpointError, match=match) as err:
        SafetensorsFile(path)
    assert str(err.value).startswith(f"{path}: invalid safetensors header: ") and "\n" not in str(err.value)


def test_a_negative_offset_in_a_models_checkpoint_fails_the_conversion(model, tmp_path):
    import struct

    path = model / "model.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    name = "model.norm.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin - end - 8, -8]  # reads the header's bytes (and spaces) as weights
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])
    msg = _fails(model, tmp_path / "out", f"tensor '{name}' has data_offsets")
    assert msg.startswith(f"{path}: ")
