"""The specd .proto package (specd.v1)."""
