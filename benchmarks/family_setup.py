"""The set-up of the scripts that decode a tiny model of every family (``check_architectures.py``,
``compile_families.py``): this checkout's specdec and tests on the path, one torch thread, and
warnings and transformers' logging quiet (the sweeps print their own verdicts).

    from family_setup import ROOT, arch_lib  # first, before specdec: a script under benchmarks/, run as a file
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

from tests import architectures as arch_lib  # noqa: E402,F401  (the one shrinker, shared with the tests)
