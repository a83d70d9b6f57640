"""The tokenizer information guided decoding needs, as upstream writes it for Triton's ``tensorrt_llm`` model.

``examples/generate_xgrammar_tokenizer_info.py`` (NVIDIA/TensorRT-LLM@7ed07f06) loads the HF tokenizer and dumps
``_xgrammar_tokenizer_info(tokenizer)`` (``tensorrt_llm/llmapi/tokenizer.py``) to ``xgrammar_tokenizer_info.json``:
``encoded_vocab`` (the vocabulary sorted by id), ``tokenizer_str`` (a fast tokenizer's backend JSON) and
``stop_token_ids`` (``[eos_token_id]``). The backend's ``xgrammar_tokenizer_info_path`` parameter names that file
(tensorrtllm_backend ``docs/guided_decoding.md``@395c4035); the CPU twin reads the same file
(:func:`trtpipe.serving.guided.tokenizer_info`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"  # the name generate_xgrammar_tokenizer_info.py writes


def upstream_tokenizer_info(tokenizer) -> dict[str, Any]:
    """``{"encoded_vocab", "tokenizer_str", "stop_token_ids"}`` of an HF fast tokenizer, as
    ``_xgrammar_tokenizer_info`` makes it.

    Raises:
        ValueError: the tokenizer is not a fast one (upstream's other branch reads a sentencepiece ``vocab_file``;
            trtpipe ships fast tokenizers only).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: it has no backend tokenizer JSON")
    vocab = tokenizer.get_vocab()
    return {
        "encoded_vocab": [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])],
        "tokenizer_str": backend.to_str(),
        "stop_token_ids": [tokenizer.eos_token_id],
    }


def write_tokenizer_info(tokenizer_dir: Path, out: Path) -> Path:
    """``out/xgrammar_tokenizer_info.json`` of the tokenizer in ``tokenizer_dir`` (no remote code is run)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    path = Path(out) / TOKENIZER_INFO_FILE
    path.write_text(json.dumps(upstream_tokenizer_info(tok)))
    return path
