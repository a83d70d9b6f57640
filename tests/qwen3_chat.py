"""A tiny Qwen3 chat model for the tool-calling tests: random weights, a real tokenizer, Qwen3's real chat template.

No Qwen3 tokenizer is available offline here, so the tokenizer is stories260k's (a real byte-fallback BPE: it
encodes any text) with Qwen3's markers added as Qwen3 adds them: ``<|im_start|>`` / ``<|im_end|>`` special, and
``<tool_call>`` / ``</tool_call>`` / ``<think>`` / ``</think>`` as plain added tokens (so decoding keeps them).
The chat template is Qwen/Qwen3-0.6B's ``tokenizer_config.json`` template (``tests/export/data/
qwen3_chat_template.jinja``). ``generation_config.json`` ends generation at ``<|im_end|>``, as Qwen3's does.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tests" / "export" / "data" / "qwen3_chat_template.jinja"
SPECIAL = ["<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def make_qwen3_chat(out: Path, seed: int = 0, markers=MARKERS, special_markers=()) -> Path:
    """Write the model directory ``out`` and return it. ``markers`` are added as plain tokens (decoding keeps them),
    ``special_markers`` as special tokens (as gpt-oss's harmony markers are): another family's output format on the
    same template and weights."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic import make_synthetic

    tok = AutoTokenizer.from_pretrained(str(REPO / "models" / "stories260k"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL + list(special_markers)})
    tok.add_tokens([AddedToken(m, normalized=False, special=False) for m in markers])
    tok.chat_template = TEMPLATE.read_text()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token = "<|im_end|>"
    tok.model_max_length = 1024
    make_synthetic("qwen3", out, seed=seed, vocab_size=len(tok), max_position_embeddings=1024)
    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out
