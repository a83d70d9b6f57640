"""Shared constants of the Triton tests (a module with a unique name: ``conftest`` is ambiguous across folders)."""

# The twin engine limits of the stories260k test engines.
BUILD_CONFIG = {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_beam_width": 1, "max_num_tokens": 2048}
