"""ApiKeys: sources merged, Bearer parsing, ids that do not reveal the key."""

from __future__ import annotations

import pytest

from splitserve.errors import SplitserveError
from splitserve.services.frontend.auth import ENV_VAR, ApiKeys, key_id


def test_sources_are_merged(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nsk-file\n\n  sk-file-2  \n")
    keys = ApiKeys.load(["sk-flag"], str(keys_file), {ENV_VAR: "sk-env-1, sk-env-2 sk-env-3"})
    for key in ("sk-flag", "sk-file", "sk-file-2", "sk-env-1", "sk-env-2", "sk-env-3"):
        assert keys.check(key) == key_id(key)
    assert len(keys.digests) == 6
    assert keys.check("sk-nope") is None and keys.check("") is None and keys.check(None) is None
    assert keys.check("# comment") is None


def test_no_keys_means_open_and_unreadable_file_is_an_error(tmp_path):
    assert not ApiKeys.load(environ={}).enabled
    with pytest.raises(SplitserveError, match="api-keys-file"):
        ApiKeys.load(keys_file=str(tmp_path / "missing"), environ={})


def test_bearer_header():
    keys = ApiKeys.load(["sk-abc"], environ={})
    assert keys.check_header("Bearer sk-abc") == key_id("sk-abc")
    assert keys.check_header("bearer   sk-abc ") == key_id("sk-abc")
    for header in (None, "", "sk-abc", "Basic sk-abc", "Bearer", "Bearer sk-abcd", "Bearer \ud800"):
        assert keys.check_header(header) is None


def test_ids_do_not_contain_the_key():
    ident = key_id("sk-secret-value")
    assert "secret" not in ident and ident.startswith("key-") and len(ident) == 16
    assert "sk-secret-value" not in repr(ApiKeys.load(["sk-secret-value"], environ={}))
