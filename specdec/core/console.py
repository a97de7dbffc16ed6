"""The one rich console on stderr that specdec's progress bars and notices print through.

While rich draws a live progress bar, text printed through the bar's own console appears above the
bar; text that any other console writes to stderr lands inside the bar's line and leaves a stray
copy of the bar behind (rich's consoles write past its stderr proxy). A first run's packing notice
(``core/packed_linear.py``) is printed while the ``progress`` observer's bar is live, so the bars
and the notices share this console. Torch-free; rich is imported on first use.
"""

from __future__ import annotations

import functools


@functools.cache
def stderr_console():
    """The shared ``rich.console.Console`` on stderr (it writes to whatever ``sys.stderr`` is at the time)."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, highlight=False)
