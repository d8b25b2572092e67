"""The signed notifications (kvgeom_nixl/protocol.py, docs/design.md §8.1): each message's MAC is
HMAC-SHA256 under the link's key of ``sender|receiver|body``, truncated to 32 hex digits. The
oracle is :mod:`hmac` called here on the message's own bytes; a message is accepted only with the
key, sender and receiver it was signed for, and one changed byte is refused (controls)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from kvgeom_nixl.protocol import decode, encode, new_secret


def _expected_mac(key: bytes, sender: str, receiver: str, body: bytes) -> bytes:
    return hmac.new(key, f"{sender}|{receiver}|".encode() + body, hashlib.sha256).hexdigest()[:32].encode()


@pytest.mark.parametrize("kind, args", [("req", (2,)), ("read", (1,)), ("held", ()), ("slot", (3, 1))])
def test_a_message_is_signed_over_sender_receiver_and_body(kind: str, args: tuple[int, ...]) -> None:
    key = new_secret()
    raw = encode(key, "D-0", "P-0", kind, "cmpl-7", 0x1234, 0xABCD, *args)
    body, _, mac = raw.rpartition(b"|")
    assert mac == _expected_mac(key, "D-0", "P-0", body)
    msg = decode(raw, "D-0", "P-0", key)
    assert msg is not None and (msg.kind, msg.args, msg.request_id, msg.d_nonce, msg.p_nonce) == \
        (kind, args, "cmpl-7", 0x1234, 0xABCD)


def test_the_same_link_signs_each_message_afresh() -> None:
    """Many messages on one link and direction, other links in between: every MAC is the one
    computed here (the per-link part kept between messages never carries a body into the next)."""
    keys = [new_secret() for _ in range(3)]
    for i in range(60):
        key, sender, receiver = keys[i % 3], f"D-{i % 2}", f"P-{i % 5}"
        raw = encode(key, sender, receiver, "req", f"r{i}", i + 1, 0, i % 4)
        body, _, mac = raw.rpartition(b"|")
        assert mac == _expected_mac(key, sender, receiver, body), i


def test_controls_another_key_sender_receiver_or_byte_is_refused() -> None:
    key, other = new_secret(), new_secret()
    raw = encode(key, "D-0", "P-0", "held", "cmpl-7", 5, 6)
    assert decode(raw, "D-0", "P-0", key) is not None
    assert decode(raw, "D-0", "P-0", other) is None
    assert decode(raw, "D-1", "P-0", key) is None
    assert decode(raw, "D-0", "P-1", key) is None
    assert decode(raw, "P-0", "D-0", key) is None  # (the other direction)
    flipped = raw.replace(b"held", b"hold")
    assert flipped != raw and decode(flipped, "D-0", "P-0", key) is None


def test_forget_keys_drops_every_kept_hmac_state() -> None:
    """An endpoint that forgets a link's key calls ``forget_keys``: nothing derived from the key
    stays in the cache; the next message is signed as before (a fresh state)."""
    from kvgeom_nixl import protocol

    key = new_secret()
    raw = encode(key, "D-0", "P-0", "held", "r", 1, 2)
    assert protocol._mac_prefix.cache_info().currsize >= 1
    protocol.forget_keys()
    assert protocol._mac_prefix.cache_info().currsize == 0
    assert encode(key, "D-0", "P-0", "held", "r", 1, 2) == raw and decode(raw, "D-0", "P-0", key) is not None
