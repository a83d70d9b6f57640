"""The oracle of guided decoding: transformers' ``generate`` with xgrammar's own HF logits processor
(``xgrammar.contrib.hf.LogitsProcessor``, xgrammar 0.2.9), on the same model in float64, the grammar compiled
from ``TokenizerInfo.from_huggingface`` (xgrammar's own path, not trtpipe's), plus the schemas the tests use.
For the llguidance backend the processor is llguidance's own mask (``llguidance.torch.fill_next_token_bitmask`` /
``apply_token_bitmask_inplace``) over its own HF tokenizer reading (``llguidance.hf.from_tokenizer``, not the
tokenizer string trtpipe hands it).

Greedy equality is exact except at a genuine near-tie: two allowed tokens whose float64 margin is within
``ORDER_FACTOR`` times the measured float32 error of the reference runtime on that sequence (tests/numerics.py).
"""

from __future__ import annotations

import json

import torch

SCHEMAS = {  # what stories260k's byte-fallback vocabulary can spell: every facet the issue names
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "pet": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": ["dog", "cat", "bird"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                },
                "required": ["kind", "legs"],
            },
        },
        "required": ["name", "pet"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "angry"]}},
        "required": ["mood"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 3}
        },
        "required": ["toys"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "number": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -5, "maximum": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["x", "n"],
        "additionalProperties": False,
    },
}


def hf_compiled(tokenizer, vocab_size: int, schema: dict):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))


class LLGuidanceLogitsProcessor:
    """transformers logits processor of llguidance's own matcher for one sequence (batch 1)."""

    def __init__(self, tokenizer, vocab_size: int, schema: dict):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size), grammar)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.started = False

    def __call__(self, input_ids, scores):
        import llguidance.torch

        if self.started:
            assert self.matcher.consume_token(int(input_ids[0, -1])), self.matcher.get_error()
        self.started = True
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        llguidance.torch.apply_token_bitmask_inplace(scores, self.mask)
        return scores


def logits_processor(backend: str, tokenizer, vocab_size: int, schema: dict):
    if backend == "llguidance":
        return LLGuidanceLogitsProcessor(tokenizer, vocab_size, schema)
    import xgrammar as xgr

    return xgr.contrib.hf.LogitsProcessor(hf_compiled(tokenizer, vocab_size, schema))


@torch.no_grad()
def hf_guided_greedy(
    hf64, tokenizer, vocab_size: int, prompt: list[int], schema: dict, n: int, eos: int, backend: str = "xgrammar"
):
    """(new tokens without the final eos, masked float64 scores per step) of transformers + the backend's own
    logits processor."""
    out = hf64.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        logits_processor=[logits_processor(backend, tokenizer, vocab_size, schema)],
        eos_token_id=eos,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    if tokens and tokens[-1] == eos:
        tokens = tokens[:-1]
    return tokens, torch.stack([s[0] for s in out.scores])


@torch.no_grad()
def check_guided_greedy(
    model32, hf64, tokenizer, vocab_size, prompt, schema, got, n, eos, backend: str = "xgrammar"
) -> str:
    """'' when ``got`` is the oracle's output or leaves it only at a near-tie among allowed tokens; else why."""
    from numerics import ORDER_FACTOR

    ref, scores = hf_guided_greedy(hf64, tokenizer, vocab_size, prompt, schema, n, eos, backend)
    if got == ref:
        return ""
    i = next((k for k in range(min(len(got), len(ref))) if got[k] != ref[k]), min(len(got), len(ref)))
    seq = list(prompt) + ref[:i]
    f32 = model32(torch.tensor([seq]))[0, -1].double()
    f64 = hf64(torch.tensor([seq])).logits[0, -1]
    bound = ORDER_FACTOR * float((f32 - f64).abs().max())
    top2 = scores[i].topk(2).values
    margin = float(top2[0] - top2[1])
    if margin <= bound:
        return ""
    return f"token {i} differs (got {got[i : i + 3]}, oracle {ref[i : i + 3]}), margin {margin:.3g} > {bound:.3g}"
