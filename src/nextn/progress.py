"""Progress bars that suit where they are shown: live on a terminal, a few lines in a log file.

tqdm redraws a bar up to ten times a second. On a terminal that is one line updated in place; in a log (CI, a
redirected stderr, a service's journal) every redraw is kept, so a long build or training run writes thousands of
lines. `progress_bar` keeps tqdm's live bar on a terminal and, elsewhere, redraws at most every
`LOG_INTERVAL_S` seconds (plus the final state), as `tqdm`'s `mininterval` allows.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

#: Seconds between two redraws when stderr is not a terminal.
LOG_INTERVAL_S = 30.0


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr (`kwargs` as tqdm's: total, desc, unit, ...), disabled when not `enabled`.

    On a terminal: tqdm's defaults. Otherwise: a redraw at most every `LOG_INTERVAL_S` seconds, fixed width, ASCII.
    """
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("maxinterval", LOG_INTERVAL_S * 4)
        kwargs.setdefault("ncols", 100)
        kwargs.setdefault("ascii", True)
    return tqdm(iterable, disable=not enabled, **kwargs)
