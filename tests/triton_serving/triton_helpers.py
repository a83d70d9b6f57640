"""Shared constants of the Triton tests (a module with a unique name: ``conftest`` is ambiguous across folders)."""

# The twin engine limits of the stories260k test engines.
BUILD_CONFIG = {
    "max_batch_size": 8,
    "max_input_len": 256,
    "max_seq_len": 512,
    "max_beam_width": 1,
    "max_num_tokens": 2048,
}


def tiny_recipe(name: str, work, model) -> str:
    """A recipe text for the stories260k fp16 engine with the limits above (work_dir quoted: tests put shell bait
    in it)."""
    b = BUILD_CONFIG
    return f"""name: {name}
work_dir: '{work}'
model:
  source: {model}
  dtype: float16
engine:
  max_batch_size: {b["max_batch_size"]}
  max_input_len: {b["max_input_len"]}
  max_seq_len: {b["max_seq_len"]}
  max_num_tokens: {b["max_num_tokens"]}
accuracy:
  num_samples: 8
  seq_len: 64
triton:
  max_batch_size: {b["max_batch_size"]}
"""


def run_concurrently(ask, n: int, timeout: float) -> dict:
    """``ask(i)`` for i in range(n), each on its own thread, all at once; ``{i: result}``, or the first error."""
    import threading

    results, errors = {}, []

    def run(i):
        try:
            results[i] = ask(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results


def like_a_terminal() -> None:
    """``preexec_fn`` for a child the test will Ctrl-C: SIGINT back to its default. A suite started in the
    background (``make test &``, a CI runner) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt, so the child would shrug off the test's Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
