"""Key names: one Redis Cluster slot per tenant, and no two names sharing a key."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from extproc.quota.keys import (
    counter_key,
    decode_name,
    encode_name,
    reservation_key,
    tenant_tag,
    window_key,
)

# Names rich in the characters that could break the layout.
names = st.text(alphabet=st.sampled_from(list("ab:{}%*-._ é\x00/")), min_size=1, max_size=8) | (
    st.text(min_size=1, max_size=12)
)
kinds = st.sampled_from(["rpm", "tpm", "tenant_tpm", "daily"])
windows = st.sampled_from([1, 60, 3600, 86400])


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes: the text between the first '{' and the next '}'."""
    start = key.index("{")
    return key[start + 1 : key.index("}", start + 1)]


@given(names)
def test_encoding_round_trips_and_holds_only_safe_characters(name: str) -> None:
    encoded = encode_name(name)
    assert re.fullmatch(r"[A-Za-z0-9._%-]*", encoded)
    assert decode_name(encoded) == name


@pytest.mark.parametrize(
    ("name", "encoded"),
    [
        ("gpt-4.1", "gpt-4.1"),
        ("3f2a9c0b7e", "3f2a9c0b7e"),
        ("Europe/Berlin", "Europe%2FBerlin"),
        ("a b%", "a%20b%25"),
        ("é", "%C3%A9"),
        ("x\n", "x%0A"),  # a trailing newline is not "all safe"
        ("~block", "%7Eblock"),
    ],
)
def test_a_safe_name_is_its_own_key_part_and_others_are_percent_encoded(
    name: str, encoded: str
) -> None:
    # Key names are what deployed counters are found by: they never change between versions.
    assert encode_name(name) == encoded


@given(names, names | st.none(), names, names | st.none(), kinds, kinds, windows, windows)
def test_different_tenant_model_pairs_never_share_a_counter_key(
    tenant_a: str,
    model_a: str | None,
    tenant_b: str,
    model_b: str | None,
    kind_a: str,
    kind_b: str,
    window_a: int,
    window_b: int,
) -> None:
    key_a = window_key(counter_key(tenant_a, kind_a, model_a, window_a), 1_700_000_000)
    key_b = window_key(counter_key(tenant_b, kind_b, model_b, window_b), 1_700_000_000)
    same_counter = (tenant_a, model_a, kind_a, window_a) == (tenant_b, model_b, kind_b, window_b)
    assert (key_a == key_b) == same_counter


@given(names, names | st.none(), kinds, windows, names)
def test_every_key_of_a_tenant_is_in_the_tenants_cluster_slot(
    tenant: str, model: str | None, kind: str, window_s: int, request_id: str
) -> None:
    counter = window_key(counter_key(tenant, kind, model, window_s), 1_700_000_040)
    record = reservation_key(tenant, request_id)
    tag = encode_name(tenant)
    assert hash_tag(counter) == hash_tag(record) == tag
    assert key_slot(counter.encode()) == key_slot(record.encode()) == key_slot(tag.encode())
    assert counter.count("{") == counter.count("}") == 1


def test_tenant_wide_counter_differs_from_any_model_counter() -> None:
    assert counter_key("t", "tenant_tpm", None, 60) != counter_key("t", "tenant_tpm", "*", 60)
    assert counter_key("t", "tpm", None, 60) == "tq:{t}:c:tpm:*:60"
    assert counter_key("t", "tpm", "*", 60) == "tq:{t}:c:tpm:%2A:60"


def test_prefix_is_configurable_but_may_not_hijack_the_hash_tag() -> None:
    assert tenant_tag("acme", prefix="prod") == "prod:{acme}"
    with pytest.raises(ValueError, match="brace"):
        tenant_tag("acme", prefix="x{y}")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: counter_key("", "tpm", "m", 60), "tenant"),
        (lambda: counter_key("t", "tpm", "", 60), "model"),
        (lambda: counter_key("t", "TPM:x", "m", 60), "kind"),
        (lambda: counter_key("t", "tpm", "m", 0), "window_s"),
        (lambda: reservation_key("t", ""), "request id"),
    ],
)
def test_bad_key_parts_are_rejected_with_a_clear_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
