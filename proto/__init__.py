"""Protobuf wire contract; generated code is derived from the .proto files (issue 4)."""
