"""The stage service's generated gRPC code (from proto/swarm.proto).

Regenerate after editing the .proto (tests/test_proto.py fails until you do):

    python -m grpc_tools.protoc -Iswarm/rpc=proto --python_out=. --grpc_python_out=. proto/swarm.proto
"""

from swarm.rpc import swarm_pb2 as pb
from swarm.rpc import swarm_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
