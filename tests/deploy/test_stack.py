"""The deployment's own files run together on loopback (the ``deployed`` fixture): Envoy on
deploy/envoy/envoy.yaml, two processors on deploy/extproc/quota.yaml sharing one Redis, llmsim
on deploy/llm-sim/fast.yaml."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from tests.deploy.conftest import DEPLOY, PRO_KEY, Deployed


def test_both_processors_are_health_checked_endpoints_of_envoy(deployed: Deployed):
    assert [deployed.envoy.processor_health(p.port) for p in deployed.processors] == [
        "healthy",
        "healthy",
    ]


def test_a_streamed_request_through_the_deployed_files_is_metered(deployed: Deployed):
    client = openai.OpenAI(base_url=f"{deployed.base_url}/v1", api_key=PRO_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="my-gpt-alias",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    # fast.yaml: one token per event, so the usage the client is shown counts the events.
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(pieces) >= 1
    assert {c.model for c in chunks} == {"gpt-4.1"}  # the quota model's upstream name


def test_the_deployed_quota_file_authenticates_and_answers_openai_errors(deployed: Deployed):
    body = json.dumps({"model": "gpt-4.1", "messages": [{"role": "user", "content": "x"}]})
    request = urllib.request.Request(
        f"{deployed.base_url}/v1/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-not-a-key"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["type"]
    request.add_header("Authorization", f"Bearer {PRO_KEY}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200
        assert reply.headers["x-ratelimit-limit-requests"]
        assert json.loads(reply.read())["usage"]["completion_tokens"] >= 1


def test_the_deployed_profile_serves_the_quota_files_models(deployed: Deployed):
    with urllib.request.urlopen(deployed.sim.url("/v1/models"), timeout=30) as reply:
        served = {m["id"] for m in json.loads(reply.read())["data"]}
    quota = yaml.safe_load((DEPLOY / "extproc" / "quota.yaml").read_text())
    for name, model in quota["models"].items():
        assert {name, *model.get("aliases", [])} <= served
    assert Path(deployed.sim.profile) == DEPLOY / "llm-sim" / "fast.yaml"
