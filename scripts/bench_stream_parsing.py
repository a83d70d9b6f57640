"""Cost of the OpenAI twin's streamed answer parsing (trtpipe/serving/chat_output.py): a long answer fed in
4-character pieces through ``ChatOutput.feed`` / ``finish``, against one ``ChatOutput.message`` of the whole text,
at a length L and 2L. Linear parsing takes about 2x at 2L; parsing that re-reads the whole text on every piece
takes about 4x. Prints seconds (best of --repeats, CPU time of this process) and the ratios of this run.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_stream_parsing.py [--calls 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

from trtpipe.serving.chat_output import ChatOutput, ToolRequest

PIECE = 4
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def qwen3_calls(n: int) -> str:
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "note": "x" * 40}}
    return "Let me look.\n" + "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n" for _ in range(n))


def harmony_calls(n: int) -> str:
    head = "<|channel|>analysis<|message|>" + "thinking " * 20 + "<|end|><|start|>assistant"
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    return head + "".join(call + "<|start|>assistant" for _ in range(n))[: -len("<|start|>assistant")]


def think_content(n: int) -> str:
    return "<think>" + "step by step, " * n + "</think>" + "The answer is 42. " * n


CASES = {  # name -> (reasoning parser, tool parser, text of size n)
    "qwen3 tool calls": (None, "qwen3", qwen3_calls),
    "harmony reasoning + tool calls": ("gpt_oss", "harmony", harmony_calls),
    "qwen3 reasoning + content": ("qwen3", None, lambda n: think_content(n * 4)),
}


def run(reasoning, tool, text, stream: bool) -> float:
    tools = ToolRequest(TOOLS, "auto") if tool else None
    out = ChatOutput(reasoning, tool, tools)
    t = time.process_time()
    if stream:
        for i in range(0, len(text), PIECE):
            out.feed(text[i : i + PIECE])
        out.finish()
    else:
        out.message(text)
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300, help="L: calls (or 4L sentences) in the shorter answer")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    for name, (reasoning, tool, make) in CASES.items():
        row = {}
        for n in (a.calls, 2 * a.calls):
            text = make(n)
            row[n] = [min(run(reasoning, tool, text, s) for _ in range(a.repeats)) for s in (True, False)]
            row[n].append(len(text))
        (s1, w1, c1), (s2, w2, c2) = row[a.calls], row[2 * a.calls]
        print(
            f"{name}: {c1} chars streamed {s1:.3f} s (whole {w1:.4f} s), {c2} chars streamed {s2:.3f} s "
            f"(whole {w2:.4f} s); 2L/L streamed {s2 / s1:.2f}x, streamed/whole at 2L {s2 / max(w2, 1e-9):.0f}x"
        )


if __name__ == "__main__":
    main()
