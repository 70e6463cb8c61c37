"""serve_app.gate's key loading, without a server: where keys come from, and malformed input named by its place,
never by its text (a key must not reach a log)."""

from __future__ import annotations

import pytest

from inflight.serve_app.config import AppConfig
from inflight.serve_app.gate import load_api_keys


def test_keys_from_the_environment_and_a_file(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n\ntenant-b  key-b-secret-2\n")
    keys = load_api_keys(str(keys_file), {"INFLIGHT_API_KEYS": "tenant-a:key-a-secret-1"})
    assert keys.tenant_of("key-a-secret-1") == "tenant-a" and keys.tenant_of("key-b-secret-2") == "tenant-b"
    assert keys.tenant_of("key-a-secret-2") is None and keys.tenant_of("") is None
    assert load_api_keys(None, {}).open


@pytest.mark.parametrize("environ, text, words", [
    ({"INFLIGHT_API_KEYS": "tenant-a:sekrit-key-1,no-colon-sekrit"}, None, "entry 2"),
    ({}, "tenant-a sekrit-key-1 extra\n", "line 1"),
    ({"INFLIGHT_API_KEYS": "tenant-a:short"}, None, "at least 8"),
])
def test_malformed_keys_are_named_without_their_text(tmp_path, environ, text, words):
    path = None
    if text is not None:
        path = tmp_path / "keys"
        path.write_text(text)
    with pytest.raises(ValueError, match=words) as caught:
        load_api_keys(str(path) if path else None, environ)
    assert "sekrit" not in str(caught.value) and "tenant-a:short" not in str(caught.value)


def test_an_unreadable_keys_file_fails_the_app_config():
    with pytest.raises(ValueError, match="api_keys_file"):
        AppConfig(api_keys_file="/nonexistent/keys")
