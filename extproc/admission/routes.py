"""Which requests may reach the model server: the metered endpoints and the model list.

Anything else (embeddings, the server's admin or metrics pages) would bypass the meter, so it
is refused. Envoy normalises paths before the processor sees them (dot segments resolved,
``//`` merged, escaped slashes redirected); this check does not rely on that: a model id
must be plain segments — never ``.`` or ``..``, no ``%``, ``\\`` or control characters — so
no spelling of a path outside ``/v1/models/`` passes for one inside it.
"""

from __future__ import annotations

import re

from extproc.endpoints import METERED_PATHS

MODELS_PATH = "/v1/models"
_MODEL_PREFIX = MODELS_PATH + "/"
# One segment of a model id (ids such as `meta-llama/Llama-3.1-8B` span several segments).
_SEGMENT = re.compile(r"[^\x00-\x1f\x7f%\\/]+")


def _model_id_ok(model_id: str) -> bool:
    return all(
        segment not in (".", "..") and _SEGMENT.fullmatch(segment) is not None
        for segment in model_id.split("/")
    )


def upstream_allowed(method: str, path: str) -> bool:
    """``POST`` on a metered endpoint, or ``GET /v1/models`` / ``GET /v1/models/<id>``.

    ``path`` is the request path without its query string.
    """
    if method == "POST":
        return path in METERED_PATHS
    if method != "GET":
        return False
    if path == MODELS_PATH:
        return True
    return path.startswith(_MODEL_PREFIX) and _model_id_ok(path[len(_MODEL_PREFIX) :])
