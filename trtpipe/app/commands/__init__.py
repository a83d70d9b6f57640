"""One module per ``trtpipe`` verb. Each defines one click command (or group) named as its module, imports only
click at module level (so ``trtpipe validate`` stays fast) and the library inside the command."""

from __future__ import annotations
