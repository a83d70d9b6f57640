"""trtpipe: one recipe from a Hugging Face checkpoint to a TensorRT-LLM engine served by Triton."""

__version__ = "0.1.0"
