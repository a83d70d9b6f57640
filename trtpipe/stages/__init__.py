"""The pipeline's stages, one module each: a plain function plus the declaration of what it reads
(:class:`trtpipe.pipeline.stage.Stage`). They compose the library packages below them; the order they run in is the
stage table, ``trtpipe.app.stage_table``."""
