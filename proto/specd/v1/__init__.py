"""Generated protobuf and gRPC code of the specd serving API, version 1 (see proto/build.py)."""
