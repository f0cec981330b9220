"""Stream and bucket names follow the subject prefix, in a form NATS accepts."""

from __future__ import annotations

from trellis.adapters.nats.jetstream import bucket_name, stream_name


def test_the_default_prefix_uses_the_contract_names() -> None:
    assert (stream_name(), bucket_name()) == ("TRELLIS_EVENTS", "TRELLIS_STATE")
    assert stream_name("trellis") == "TRELLIS_EVENTS"


def test_another_prefix_gets_names_of_its_own_that_nats_accepts() -> None:
    assert stream_name("t0123456789ab") == "TRELLIS_EVENTS_t0123456789ab"
    assert bucket_name("acme.trellis") == "TRELLIS_STATE_acme_trellis"
    assert stream_name("a b/c*>") == "TRELLIS_EVENTS_a_b_c__"
