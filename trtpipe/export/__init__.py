"""The llmapi target: checkpoints for TensorRT-LLM's PyTorch backend (ModelOpt's unified HF format), for vLLM /
SGLang (compressed-tensors), and the serving artifacts that launch them (trtllm-serve, Triton ``llmapi``)."""
