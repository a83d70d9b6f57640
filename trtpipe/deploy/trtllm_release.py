"""The TensorRT-LLM release inside the Dynamo runtime image trtpipe's graphs name, and what ``deploy dynamo`` does
when the recipe's ``llmapi.version`` is another one.

Dynamo ships TensorRT-LLM 1.3 release candidates, never 1.2 GA. The ai-dynamo 1.6.1 wheel (the release of the image
``tensorrtllm-runtime:1.6.1``) declares ``Requires-Dist: tensorrt-llm==1.3.0rc29; extra == 'trtllm'`` in its
METADATA (read from the wheel installed in ``.venv-dynamo``; ``tests/deploy/test_trtllm_release.py`` reads it
again), and ai-dynamo/dynamo ``docs/fern/assets/releases.json@02da5a965062cb3b52dfedb9132a9c3997e22b6d`` pins
``trtllm`` to a ``1.3.0rcN`` in every release from v0.9.0 (1.3.0rc1) to v1.3.0 (1.3.0rc19, the newest that stored
file lists). That the image carries exactly the rc its wheel's extra pins is taken, not checked (the image was not
pulled).

So an engine YAML written from the 1.3 key table is what that worker reads. A recipe on another release is
refused when its YAML holds a key the 1.3 table does not (the worker's TorchLlmArgs would reject the file at
start), and otherwise warned about: its keys load on 1.3, but it was validated for another release.
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.errors import TrtpipeError
from trtpipe.export.serving import UnknownLLMAPIKey, checked
from trtpipe.recipe.schema import Recipe

DYNAMO_TRTLLM = "1.3"  # the llmapi.version of the TensorRT-LLM inside tensorrtllm-runtime:1.6.x
DYNAMO_TRTLLM_PIN = "1.3.0rc29"  # ai-dynamo 1.6.1's METADATA: Requires-Dist: tensorrt-llm==1.3.0rc29; extra == 'trtllm'
SOURCE = f"ai-dynamo 1.6.1 requires tensorrt-llm=={DYNAMO_TRTLLM_PIN}; releases.json@02da5a96: 1.3.0rc since v0.9.0"


def runtime_mismatch(recipe: Recipe, engines: Iterable[dict], image: str) -> Optional[str]:
    """None when ``llmapi.version`` is the runtime's; a warning when the engine YAMLs still load there; raises
    :class:`TrtpipeError` (one line) when one of them holds a key the runtime's TensorRT-LLM does not take."""
    version = recipe.llmapi.version
    if version == DYNAMO_TRTLLM:
        return None
    for opts in engines:
        try:
            checked(opts, DYNAMO_TRTLLM)
        except UnknownLLMAPIKey as exc:
            raise TrtpipeError(
                f"llmapi.version: {version}, but {image} carries TensorRT-LLM {DYNAMO_TRTLLM} ({SOURCE}): "
                f'{str(exc).split(": ", 1)[1]}; set llmapi.version: "{DYNAMO_TRTLLM}"'
            ) from None
    return (
        f"warning: llmapi.version is {version}, but {image} carries TensorRT-LLM {DYNAMO_TRTLLM} ({SOURCE}); "
        f'the engine YAMLs use keys 1.3 also takes, but set llmapi.version: "{DYNAMO_TRTLLM}" to validate for it'
    )
