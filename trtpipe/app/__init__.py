"""The application layer: what composes the library into the ``trtpipe`` commands.

``commands/`` holds one module per CLI verb (``trtpipe/cli.py`` only registers them); beside it live the
composition roots that every command shares: the recipe rule list (``validation``), the stage table
(``stage_table``), and the launchers that start servers for ``serve``, ``batch`` and ``bench``. Nothing in a library
package imports from here.
"""
