"""Text in, text out over the reference runtime (``trtpipe generate``): tokenizer beside the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # never run shipped code
    except Exception as exc:  # transformers raises OSError/ValueError/... for a dir without a tokenizer
        raise CheckpointError(
            f"{path}: cannot load a tokenizer ({str(exc).splitlines()[0]}); pass --tokenizer DIR"
        ) from None


def end_id(ckpt_dir: Path, tokenizer) -> Optional[int]:
    """eos from generation_config.json (first if a list), else the tokenizer's."""
    gen = ckpt_dir / "generation_config.json"
    if gen.exists():
        eos = load_json(gen, CheckpointError).get("eos_token_id")
        if eos is not None:
            return int(eos[0] if isinstance(eos, list) else eos)
    return tokenizer.eos_token_id


def generate_text(
    ckpt_dir: str | Path,
    prompt: str,
    max_tokens: int = 64,
    tokenizer_dir: Optional[str | Path] = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    on_text: Optional[Callable[[str], None]] = None,
) -> str:
    """Continue ``prompt`` with the checkpoint at ``ckpt_dir``; ``on_text`` receives each new piece of text."""
    from trtpipe.runtime.generate import generate
    from trtpipe.runtime.loader import load_checkpoint

    ckpt_dir = Path(ckpt_dir)
    tok = load_tokenizer(tokenizer_dir or ckpt_dir)
    model = load_checkpoint(ckpt_dir)
    ids = tok(prompt)["input_ids"]
    new: list[int] = []
    shown = ""

    def step(tokens):
        nonlocal shown
        if on_text is None or tokens[0] is None:
            return
        new.extend(tokens[0])
        text = tok.decode(new, skip_special_tokens=True)
        on_text(text[len(shown) :])
        shown = text

    out = generate(
        model,
        [ids],
        max_tokens,
        end_ids=end_id(ckpt_dir, tok),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        on_step=step,
    )
    return tok.decode(out[0], skip_special_tokens=True)


def stream_text(
    ckpt_dir: str | Path,
    prompt: str,
    max_tokens: int,
    tokenizer_dir: Optional[str | Path],
    temperature: float,
    top_k: int,
    top_p: float,
    seed: Optional[int],
    write: Callable[[str], None],
) -> None:
    """``trtpipe generate``: write the prompt, then each new piece of text, then a newline. The prompt is written
    once the model and tokenizer loaded, so a bad input leaves the output empty."""
    started = []

    def emit(piece: str) -> None:
        if not started:
            started.append(True)
            write(prompt)
        write(piece)

    generate_text(ckpt_dir, prompt, max_tokens, tokenizer_dir, temperature, top_k, top_p, seed, on_text=emit)
    if not started:
        write(prompt)
    write("\n")
