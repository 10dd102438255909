"""Make tests/workers/core importable (toy.py) whatever pytest's import mode is."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
