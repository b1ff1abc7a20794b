"""Raw frames of FetchRaw: length prefix, Chunk metadata, bytes."""

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.errors import ProtocolError
from collective.transport.grpc import frame, split_frame


def test_a_frame_round_trips_metadata_and_bytes_without_copying_them_into_the_metadata():
    msg = pb.Chunk(offset=128, group_key=1, instance_keys=[3, 4])
    data = memoryview(np.arange(100, dtype=np.uint8))
    meta, out = split_frame(frame(msg, data))
    assert meta == msg and not meta.data
    assert bytes(out) == bytes(data)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"\x01", "shorter than its length prefix"),
        (b"\xff\xff\x00\x00abc", "metadata has 65535 bytes"),
        (b"\x03\x00\x00\x00\xff\xff\xff", "not a Chunk"),
        (b"\x04\x00\x00\x00" + pb.Chunk(data=b"xy").SerializeToString(), "carries bytes of its own"),
    ],
)
def test_a_malformed_frame_is_a_protocol_error(raw, words):
    with pytest.raises(ProtocolError, match=words):
        split_frame(raw)
