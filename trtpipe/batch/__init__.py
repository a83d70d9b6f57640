"""``trtpipe batch``: an OpenAI Batch input file (JSONL) run against a served model, surviving crashes.

The modules, in the order a job uses them: :mod:`~trtpipe.batch.requests` reads and validates the input,
:mod:`~trtpipe.batch.journal` recovers and appends the output and errors files (the source of truth for what is
done) and checkpoints the state file, :mod:`~trtpipe.app.batch_target` serves a recipe for the job or takes a URL,
:mod:`~trtpipe.batch.pressure` decides how many requests may be in flight, :mod:`~trtpipe.batch.client` sends
them, and :mod:`~trtpipe.app.batch_job` ties these together for the CLI.
"""
