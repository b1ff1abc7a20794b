"""The committed protobuf/gRPC modules are what `make proto` makes from protos/collective.proto."""

from collective._protogen import stale_files


def test_generated_proto_modules_are_not_stale():
    stale = stale_files()
    assert not stale, f"run `make proto` and commit: {', '.join(stale)} differ from protos/collective.proto"
