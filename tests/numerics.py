"""Tolerances derived from a float64 reference and the format's unit roundoff, never from one machine's output.

The rule every numeric test follows: run the same function in float64 (the reference; its own round-off,
2^-53, is negligible), measure how far a float32 evaluation that is known to be right lies from it (the
*error scale*: transformers' float32 output, or our unbatched path), and allow the evaluation under test to be
off by at most ``ORDER_FACTOR`` times that scale.

Why a factor and not equality: CPU kernels (AVX-512, AVX2, the scalar ``default`` path, 1 or 2 threads)
sum in different orders, and gemm (B rows) blocks differently from gemv (one row); every order has the same
worst-case bound (gamma_n * sum |terms|), but the realised errors differ by a small factor (measured on
stories260k: the batched row's error stays under 1.5x the unbatched runs' largest error across the
default/avx2/avx512 kernels at 1 and 2 threads).
``ORDER_FACTOR = 4`` covers that while a real bug (a wrong position, mask, cache row, shard) is off by
orders of magnitude more (logit errors ~1e-1 against a float32 scale ~1e-5).

The error scale is measured on the machine that runs the test, so it follows that machine's kernels.
"""

from __future__ import annotations

import copy
import os

import torch

U32 = 2.0**-24  # unit roundoff of float32
U16 = 2.0**-11  # float16
UBF16 = 2.0**-8  # bfloat16
ORDER_FACTOR = 4.0


def suite_threads() -> int:
    """torch threads for the suite: TRTPIPE_TEST_THREADS (default 1; CI and the portability runs also use 2)."""
    return int(os.environ.get("TRTPIPE_TEST_THREADS", "1"))


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of a reference model (or any module) with every floating tensor in float64: the reference.

    Tensors held as plain attributes (norm weights, embedding tables, scales) are converted as well as
    parameters; fp8/int8 fake-quant round trips still quantize the same way (their inputs are float32-rounded
    first, which is below the format's step).
    """
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                setattr(mod, name, value.double())
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_floating_point():
                mod._parameters[name] = torch.nn.Parameter(p.data.double(), requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.double()
    return ref


def error_scale(x: torch.Tensor, ref64: torch.Tensor, u: float = U32) -> float:
    """max |x - ref64|, but never below one rounding of the largest reference value (u * max |ref64|)."""
    ref64 = ref64.double()
    return max(float((x.double() - ref64).abs().max()), u * float(ref64.abs().max()))


def assert_as_accurate(
    got: torch.Tensor, ref64: torch.Tensor, scale: float, what: str = "", factor: float = ORDER_FACTOR
) -> float:
    """|got - ref64| <= factor * scale everywhere, where ``scale`` is the error of a known-good evaluation of
    the same function in the same format (see :func:`error_scale`). Returns the observed max error."""
    err = float((got.double() - ref64.double()).abs().max())
    assert err <= factor * scale, (
        f"{what}: max |x - float64| = {err:.3g} > {factor:g} x the format's error scale {scale:.3g} "
        f"(ratio {err / scale:.2f})"
    )
    return err


def top2_margin(logits64: torch.Tensor) -> float:
    """Gap between the largest and second largest float64 logit (of one position)."""
    top = logits64.double().topk(2).values
    return float(top[0] - top[1])


def greedy_is_decided(logits64: torch.Tensor, bound: float) -> bool:
    """True when the argmax cannot change under a per-logit error of ``bound``: any float32 evaluation within
    ``bound`` of the float64 logits must pick the same token (margin > 2 * bound). False is a genuine near-tie."""
    return top2_margin(logits64) > 2 * bound


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] of one sequence, in the model's own dtype."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def first_near_tie(hf32, hf64, prompt: list[int], tokens: list[int]) -> tuple[int, str]:
    """Where greedy decoding of ``tokens`` after ``prompt`` stops being decided by the model.

    Runs transformers in float32 and float64 over the whole sequence; the float32 error scale is measured on
    it and each step's float64 top-2 margin must exceed 2 x ORDER_FACTOR x that scale for every correct
    float32 implementation to pick the same token. Returns (index of the first undecided token, or
    len(tokens); a description of that near-tie, or "").
    """
    if not tokens:
        return 0, ""
    ids = prompt + tokens
    l32, l64 = hf_logits(hf32, ids), hf_logits(hf64, ids)
    steps = slice(len(prompt) - 1, len(ids) - 1)  # the position that predicts each token
    bound = ORDER_FACTOR * error_scale(l32[steps], l64[steps])
    for i, row in enumerate(l64[steps]):
        if not greedy_is_decided(row, bound):
            return i, (
                f"token {i}: float64 top-2 margin {top2_margin(row):.3g} <= 2 x float32 error bound "
                f"{bound:.3g} (a genuine near-tie)"
            )
    return len(tokens), ""


def assert_greedy_equal(ours: list[int], ref: list[int], hf32, hf64, prompt: list[int], what: str = "", eos=()) -> int:
    """Greedy tokens == transformers' ``ref`` (as generated, end id included), up to the first genuine near-tie.

    ``ours`` stops before an end id in ``eos``. Returns how many tokens were compared. A near-tie is
    reported, never silently widened: the tokens before it must match exactly; a divergence at or after it
    is what float32 summation order may legally cause.
    """
    eos = {eos} if isinstance(eos, int) else set(eos)
    end = next((i for i, t in enumerate(ref) if t in eos), len(ref))
    n, tie = first_near_tie(hf32, hf64, prompt, ref)
    if n == len(ref):
        assert ours == ref[:end], what
        return end
    print(f"{what}: comparing {min(n, end)} of {end} tokens; {tie}")
    assert ours[: min(n, end)] == ref[: min(n, end)], what
    return min(n, end)


def hf_float64(model):
    """A float64 copy of a transformers model (MoE experts on the eager path: grouped_mm has no float64)."""
    ref = copy.deepcopy(model).double()
    if getattr(ref.config, "num_local_experts", None) or getattr(ref.config, "num_experts", None):
        ref.set_experts_implementation("eager")
    return ref


U64 = 2.0**-53  # float64


def assert_same_model(a, b, ids: torch.Tensor, what: str = "") -> float:
    """Two layouts (tp/pp/ep splits) of one quantized model compute the same function: checked in float64.

    In float32, summation order can move an activation across a fake-quant rounding boundary (one code
    step, far above float32's error). Run in float64 the two layouts' inputs to each quantizer round to the
    same float32 value except within 2^-53 of a boundary, so they must agree to float64's error: the
    model's float32 error scale (``b`` in float32 against float64) times U64/U32.
    """
    with torch.no_grad():
        x, y = float64_copy(a)(ids), float64_copy(b)(ids)
        scale32 = error_scale(b(ids), y)
    return assert_as_accurate(x, y, scale32 * U64 / U32, what)


def float32_scale(model, ids: torch.Tensor) -> float:
    """float32's error on this model's logits for ``ids``, measured against its float64 copy."""
    with torch.no_grad():
        return error_scale(model(ids), float64_copy(model)(ids))


def chi_square_pvalue(samples: list[int], p) -> float:
    """p-value of the counts of ``samples`` (token ids) against the distribution ``p`` (chi-square goodness of fit;
    the bins whose expected count is below 5 are pooled into one)."""
    import numpy as np
    from scipy.stats import chisquare

    p = np.asarray(p, np.float64)
    n = len(samples)
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    big = p * n >= 5
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(p[big] * n, p[~big].sum() * n)
    return float(chisquare(f_obs, f_exp).pvalue)
