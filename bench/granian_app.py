"""passerelle's ASGI app, for granian to serve (bench/overhead.py's ``passerelle-granian`` target).

granian imports this module in its worker process: the configuration file comes from
``PASSERELLE_BENCH_CONFIG``, the address from ``PASSERELLE_BENCH_HOST`` and ``PASSERELLE_BENCH_PORT``
(the one granian listens on, which the app's start-up banner and links name).
"""

from __future__ import annotations

import os

from passerelle.cli import _setup_logging, build_app
from passerelle.config import load_config, with_server

_setup_logging()
app = build_app(with_server(load_config(os.environ["PASSERELLE_BENCH_CONFIG"]),
                            host=os.environ["PASSERELLE_BENCH_HOST"], port=int(os.environ["PASSERELLE_BENCH_PORT"])))
