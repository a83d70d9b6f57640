"""The EAGLE-3 tree recipes the OpenAI twin and the Triton llmapi twin are both tested with: an llmapi 1.3 recipe of
stories260k deepened to 8 layers with a trained EAGLE-3 head, as a static tree (``eagle_choices``, two-model) and as
EAGLE-2's dynamic tree (``use_dynamic_tree``, one-model) of as many draft tokens."""

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park.", "One day, a big"]
TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]
RECIPE = """\
name: eagle3-tree
target: llmapi
model:
  source: {model}
engine:
  gpu: h100-sxm-80gb
  max_batch_size: 4
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: 2048
  kv_cache:
    enable_reuse: false
accuracy:
  enabled: false
llmapi:
  version: "1.3"
speculative:
  decoding_type: Eagle3
  speculative_model: {head}
{spec}
"""
SPECS = {
    "static": f"  max_draft_len: {len(TREE)}\n  eagle3_one_model: false\n  eagle_choices: {TREE}",
    "dynamic": (
        "  max_draft_len: 3\n  eagle3_one_model: true\n  use_dynamic_tree: true\n  dynamic_tree_max_top_k: 3\n"
        f"  max_total_draft_tokens: {len(TREE)}"
    ),
}
