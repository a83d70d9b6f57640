"""A model's end tokens, as TensorRT-LLM's LLM API sets them up for every request, for every twin front end.

``SamplingParams._setup`` (``tensorrt_llm/sampling_params.py``, read at zhaoyangwang-nvidia/TensorRT-LLM
@138362f44f01dd1d0c3b7a0e41b3c62fde5ebe6e, a fork of NVIDIA/TensorRT-LLM of 2026) takes ``end_id`` from the
tokenizer's ``eos_token_id`` and appends every id of ``generation_config.eos_token_id`` (an int or a list) that is not
the end id and not already there to ``stop_token_ids``: "The eos_token_id in generation_config are really mean to stop
the text generation." So gpt-oss (``eos_token_id: [200002, 199999, 200012]``: harmony's ``<|return|>``,
``<|endoftext|>``, ``<|call|>``) ends on any of the three, each a ``stop`` finish. Older revisions did this for
``qwen3_next`` only (codego7250/TensorRT-LLM @208eda663eeae94cee752dfc122468847aaf3fe6) or not at all, taking the
generation config's end id for ``kimi_k2`` alone (NVIDIA/TensorRT-LLM @a98a9061d72f6fd39f5d055ebdd2c6878a100e2c);
the twin follows the newest rule it found. Whether the rule is on NVIDIA's main branch was not confirmed (the
repository is over the fetch limit).

Twin choices, said plainly: a model with no tokenizer end id takes the generation config's first id as its end id
(upstream would have none); ``ignore_eos`` drops the model's extra end tokens too (a request's own
``stop_token_ids`` still stop it), since they are end tokens of the model (whether TensorRT-LLM keeps them under
``ignore_eos`` was not confirmed); ``min_tokens`` bans the end id only (``MinLengthPenalty`` bans ``end_id``).

Pure (one JSON read): :func:`read_end_tokens` is what the OpenAI twin, the Triton ``llmapi`` twin and the Dynamo
worker each call once at start-up, and :meth:`EndTokens.for_request` what each calls per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from trtpipe.errors import ServingError
from trtpipe.jsonfile import load_json


@dataclass(frozen=True)
class EndTokens:
    end_id: Optional[int] = None  # the request's end id: not kept in the output
    stop_ids: tuple[int, ...] = ()  # the model's other end tokens: each ends a request as a stop token

    def for_request(self, ignore_eos: bool = False, stop_token_ids: Iterable[int] = ()) -> tuple[Optional[int], tuple]:
        """``(end_id, stop token ids)`` of one request: its own ``stop_token_ids`` then the model's other end
        tokens, each once and never the end id; ``ignore_eos`` leaves the request's own stop ids only."""
        end = None if ignore_eos else self.end_id
        extra = () if ignore_eos else self.stop_ids
        return end, _unique((*stop_token_ids, *extra), end)


def _unique(ids: Iterable[int], drop: Optional[int]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if int(i) != drop and int(i) not in out:
            out.append(int(i))
    return tuple(out)


def eos_ids(value, where: str) -> list[int]:
    """``eos_token_id`` of a config (an int, a list of ints or absent) as a list; anything else is a ServingError
    naming ``where``."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ServingError(f"{where}: eos_token_id must be a token id or a list of token ids, got {value!r}")
    return [int(i) for i in items]


def end_tokens(generation_eos: Sequence[int], tokenizer_eos: Optional[int]) -> EndTokens:
    """The end id (the tokenizer's, else the generation config's first) and the generation config's other ids."""
    end = tokenizer_eos if tokenizer_eos is not None else (generation_eos[0] if generation_eos else None)
    return EndTokens(end, _unique(generation_eos, end))


def read_end_tokens(model_dir: Path, tokenizer_eos: Optional[int] = None) -> EndTokens:
    """:func:`end_tokens` of a model directory's ``generation_config.json``; without a tokenizer end id the
    generation config's first id is the end id, else ``config.json``'s."""
    model_dir = Path(model_dir)
    gen = model_dir / "generation_config.json"
    ids = eos_ids(load_json(gen, ServingError).get("eos_token_id"), str(gen)) if gen.is_file() else []
    if tokenizer_eos is None and not ids:
        cfg = model_dir / "config.json"
        if cfg.is_file():
            ids = eos_ids(load_json(cfg, ServingError).get("eos_token_id"), str(cfg))
    return end_tokens(ids, tokenizer_eos)
