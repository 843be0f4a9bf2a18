"""The processor's allow-list of what may reach the model server."""

from __future__ import annotations

import posixpath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.admission.routes import upstream_allowed
from extproc.endpoints import METERED_PATHS


@pytest.mark.parametrize("path", sorted(METERED_PATHS))
def test_metered_endpoints_are_allowed_for_post_only(path: str) -> None:
    assert upstream_allowed("POST", path)
    assert not upstream_allowed("GET", path)
    assert not upstream_allowed("PUT", path)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "/v1/models/gpt-4.1",
        "/v1/models/meta-llama/Llama-3.1-8B",
        "/v1/models/org/family/model:variant",
        "/v1/models/ft:gpt-4o-mini:acme::abc123",
        "/v1/models/...",  # three dots is a name, not a dot segment
        "/v1/models/.hidden",
    ],
)
def test_the_model_list_and_model_ids_are_allowed_for_get(path: str) -> None:
    assert upstream_allowed("GET", path)
    assert not upstream_allowed("POST", path)
    assert not upstream_allowed("HEAD", path)
    assert not upstream_allowed("get", path)


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models/../x"),
        ("GET", "/v1/models/.."),
        ("GET", "/v1/models/."),
        ("GET", "/v1/models/./x"),
        ("GET", "/v1/models/a/../../admin/config"),
        ("GET", "/v1/models/a/.."),
        ("GET", "/v1/models/"),
        ("GET", "/v1/models//x"),
        ("GET", "/v1/models/x/"),
        ("GET", "/v1//models"),
        ("GET", "//v1/models"),
        ("GET", "/v1/modelsx"),
        ("GET", "/v1/models-admin"),
        ("GET", "/v1/models%2F..%2Fx"),
        ("GET", "/v1/models/%2e%2e/admin"),
        ("GET", "/v1/models/..%2Fadmin"),
        ("GET", "/v1/models/meta-llama%2FLlama-3.1-8B"),
        ("GET", "/v1/models/%252e%252e/x"),
        ("GET", "/v1/models/..\\admin"),
        ("GET", "/v1/models\\..\\admin"),
        ("GET", "/v1/models/a\x00b"),
        ("GET", "/v1/models/a\nb"),
        ("GET", "/v1/models/a\tb"),
        ("GET", "/v1/models/a\x7fb"),
        ("GET", "/v1/embeddings"),
        ("GET", "/admin/config"),
        ("GET", "/metrics"),
        ("GET", ""),
        ("GET", "/"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1//chat/completions"),
        ("POST", "/v1/chat/completions/../../admin/config"),
        ("POST", "/v1/models"),
        ("DELETE", "/v1/models/gpt-4.1"),
        ("OPTIONS", "/v1/chat/completions"),
    ],
)
def test_everything_else_is_refused(method: str, path: str) -> None:
    assert not upstream_allowed(method, path)


@given(st.text(alphabet=st.sampled_from("/.%\\\x00\n abcv1models-_:2Fe"), max_size=40))
def test_an_allowed_get_path_names_itself_under_v1_models(suffix: str) -> None:
    """Whatever the spelling, an allowed GET is the list or a plain path below it: resolving
    dot segments changes nothing, and nothing in it can be decoded into something else."""
    for path in ("/v1/models" + suffix, "/v1/models/" + suffix, suffix):
        if not upstream_allowed("GET", path):
            continue
        assert path == "/v1/models" or path.startswith("/v1/models/")
        assert posixpath.normpath(path) == path
        assert not any(c in path for c in "%\\") and path.isprintable()
