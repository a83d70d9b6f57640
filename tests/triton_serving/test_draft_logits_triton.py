"""Draft logits through a real tritonserver (CPU twin), the two-model form's models called as upstream's BLS calls
them with ``use_draft_logits`` (``tensorrt_llm_bls/1/lib/decode.py@4db68284``): ``tensorrt_llm_draft`` generates k
sampled tokens with ``return_generation_logits``, ``tensorrt_llm`` gets them as ``draft_input_ids`` with those rows as
``draft_logits`` and verifies them by rejection sampling (trtpipe/serving/draft_logits.py).

Target stories260k (float32, 5 layers), draft its first 4 layers, both built by the pipeline. Over N seeded trials the
target's first output token must be distributed as transformers' float64 next-token distribution at temperature 1
(chi-square goodness of fit, p-value printed; tests/serving/test_draft_logits.py shows the same test failing for a
wrong draft distribution). The BLS's own forwarding of the logits: tests/triton_serving/test_speculative_triton.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from numerics import chi_square_pvalue  # noqa: E402
from test_speculative_triton import K, build_repo, speculative  # noqa: E402
from trtpipe.triton.client import infer_inputs  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]
N = 600
ALPHA = 1e-3  # the goodness-of-fit test's level: a correct sampler fails it once in a thousand runs
PROMPT = [1, 403, 407, 261, 378, 285]


@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory, stories_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("cut") / "stories-4l"
    shutil.copytree(stories_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    keep = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4}
    save_file(keep, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _call(raw, grpcclient, model: str, rows, names):
    result = raw.infer(
        model, infer_inputs(grpcclient, rows), outputs=[grpcclient.InferRequestedOutput(x) for x in names]
    )
    return {x: result.as_numpy(x) for x in names}


def _rows(ids, n, seed, **extra):
    rows = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[n]], np.int32), "INT32"),
        ("end_id", np.array([[-1]], np.int32), "INT32"),
        ("exclude_input_in_output", np.array([[True]]), "BOOL"),
        ("temperature", np.array([[1.0]], np.float32), "FP32"),
        ("runtime_top_p", np.array([[1.0]], np.float32), "FP32"),  # top_k 0 with top_p 0 is greedy, as upstream
        ("seed", np.array([[seed]], np.uint64), "UINT64"),
    ]
    for name, (value, kind) in extra.items():
        rows.append((name, value, kind))
    return rows


def test_sampled_first_token_keeps_the_targets_distribution_through_tritonserver(
    stories_dir, cut_draft, tmp_path_factory
):
    import torch
    import tritonclient.grpc as grpcclient

    from numerics import hf_float64
    from trtpipe.models.synthetic import load_hf

    with torch.no_grad():
        p = torch.softmax(hf_float64(load_hf(stories_dir))(torch.tensor([PROMPT])).logits[0, -1], -1).numpy()
    repo = build_repo(tmp_path_factory.mktemp("dl"), stories_dir, *speculative(cut_draft))
    first, accepted = [], 0
    with start_server(repo, timeout=240) as server, grpcclient.InferenceServerClient(server.grpc_url) as raw:
        for i in range(N):
            d = _call(
                raw,
                grpcclient,
                "tensorrt_llm_draft",
                _rows(
                    PROMPT,
                    K,
                    10_000 + i,
                    min_tokens=(np.array([[K]], np.int32), "INT32"),
                    return_generation_logits=(np.array([[True]]), "BOOL"),
                ),
                ["output_ids", "generation_logits"],
            )
            drafts = d["output_ids"].reshape(-1)[:K].astype(np.int32)
            logits = d["generation_logits"][0][0].astype(np.float32)  # [1, beam, K, V] -> [K, V]
            assert logits.shape == (K, 512)
            t = _call(
                raw,
                grpcclient,
                "tensorrt_llm",
                _rows(
                    PROMPT,
                    K + 1,
                    20_000 + i,
                    draft_input_ids=(drafts[None], "INT32"),
                    draft_logits=(logits[None], "FP32"),
                    return_perf_metrics=(np.array([[True]]), "BOOL"),
                ),
                ["output_ids", "total_accepted_draft_tokens"],
            )
            first.append(int(t["output_ids"].reshape(-1)[0]))
            accepted += int(t["total_accepted_draft_tokens"].reshape(-1)[0])
    pvalue = chi_square_pvalue(first, p)
    print(
        f"\ndraft logits through tritonserver: chi-square p-value {pvalue:.4f} over {N} trials; "
        f"accepted {accepted} of {K * N} drafts"
    )
    assert pvalue > ALPHA
    assert 0 < accepted < K * N
