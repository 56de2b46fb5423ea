"""The v1 wire contract: `.proto` files and the protobuf/gRPC code generated from them."""
