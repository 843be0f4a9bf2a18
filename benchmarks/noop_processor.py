"""The no-op FDX processor, the benchmarks' baseline (moved to ``loadlab.noop_processor``).

.venv/bin/python -m loadlab.noop_processor --listen 127.0.0.1:50061
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadlab.noop_processor import main

if __name__ == "__main__":
    main()
