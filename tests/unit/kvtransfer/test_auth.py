"""Transfer-token tags: what they cover, constant-time checks, metadata signing (no processes)."""

from __future__ import annotations

import dataclasses

from splitserve.kvtransfer import auth
from splitserve.kvtransfer.connector import AgentMetadata
from splitserve.kvtransfer.layout import KVLayout


def _meta(**changes) -> AgentMetadata:
    layout = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    meta = AgentMetadata("decode-0", "inc-1", "tcp", "127.0.0.1:5000", layout, layout.layout_hash(), 16,
                         (4096, 8192), "cpu", b"blob")
    return dataclasses.replace(meta, **changes)


def test_tags_bind_every_part_and_need_the_token():
    t = auth.tag(b"secret", "a", 1, b"c")
    assert len(t) == auth.TAG_BYTES
    assert auth.verify(b"secret", t, "a", 1, b"c")
    assert not auth.verify(b"other", t, "a", 1, b"c")
    assert not auth.verify(b"secret", t, "a", 2, b"c")
    assert auth.tag(b"k", "ab", "c") != auth.tag(b"k", "a", "bc")     # length-prefixed parts
    assert auth.verify(b"", b"", "anything")                           # no token: nothing required


def test_signed_metadata_survives_the_wire_and_detects_tampering():
    meta = _meta()
    signed = dataclasses.replace(meta, auth=auth.tag(b"tok", *meta.signed_fields()))
    back = AgentMetadata.from_bytes(signed.to_bytes())
    assert back == signed and auth.verify(b"tok", back.auth, *back.signed_fields())
    for change in (dict(address="10.0.0.9:5000"), dict(num_blocks=17), dict(agent_blob=b"other"),
                   dict(layer_base_addrs=(4096, 8193)), dict(incarnation="inc-2")):
        forged = dataclasses.replace(back, **change)
        assert not auth.verify(b"tok", forged.auth, *forged.signed_fields()), change


def test_metadata_without_auth_field_still_parses():
    import json

    values = json.loads(_meta().to_bytes())
    del values["auth"]
    assert AgentMetadata.from_bytes(json.dumps(values).encode()).auth == b""


def test_token_sources():
    assert auth.token_from("flag", {auth.TOKEN_ENV: "env"}) == b"flag"
    assert auth.token_from(None, {auth.TOKEN_ENV: " env "}) == b"env"
    assert auth.token_from(None, {}) == b""
