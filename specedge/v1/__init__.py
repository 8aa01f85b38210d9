"""Generated gRPC stubs for wire version 1 (see protos/)."""
