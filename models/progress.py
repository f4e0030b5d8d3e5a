"""Progress bars: tqdm's notebook widget where ipywidgets is installed, its text bar everywhere else.

`tqdm.auto` picks the widget inside Jupyter and warns at import when ipywidgets is missing; the warning is
noise in a notebook that asked for no bar, so the choice is made here, once, without it.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def _tqdm():
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    return tqdm


def progress(*args, **kwargs):
    """`tqdm(*args, **kwargs)` of the kind this environment can show."""
    return _tqdm()(*args, **kwargs)
