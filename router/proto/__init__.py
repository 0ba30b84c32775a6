"""The gRPC API's protocol (`generate.proto`) and the code grpcio-tools generates from it."""
