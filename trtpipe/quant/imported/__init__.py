"""Checkpoints others already quantized: recognise the format, check it against its tensors, and turn it into
what each target loads (a TensorRT-LLM checkpoint for ``trtllm-build``, or an HF directory for the PyTorch
backend) without recalibrating.

* :mod:`.formats` - :class:`ImportedFormat`, the one-line description of a recognised format and, per target,
  what happens to it (converted / passed through / re-laid out / refused, with the reason).
* :mod:`.detect` - the table from ``hf_quant_config.json`` / ``config.json: quantization_config`` to a parser.
* one module per format family (:mod:`.modelopt`, :mod:`.compressed`, :mod:`.gptq`, :mod:`.awq`, :mod:`.others`):
  its config keys, its tensor checks and its re-layout into ModelOpt's unified per-projection tensors (the
  canonical form here, plus a zero point for zero-point INT4).
* :mod:`.trtllm` - canonical per-projection tensors -> fused, sharded TensorRT-LLM checkpoint tensors, as
  ModelOpt's own TensorRT-LLM export fuses them.
"""
