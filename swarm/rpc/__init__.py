"""The stage service: its messages, generated from proto/swarm.proto, and its one table of methods.

Only the messages are generated. The client (swarm/client.py) and the server (peer/service.py)
serialize and parse the bytes themselves, to count what crosses the wire and to answer a request
that does not parse with a clear INVALID_ARGUMENT, so grpc-python's generated stub and servicer
would go unused; the method table below is read from the generated descriptor instead, so it
cannot drift from the .proto. Regenerate after editing the .proto (tests/test_proto.py fails
until you do):

    python -m grpc_tools.protoc -Iswarm/rpc=proto --python_out=. proto/swarm.proto
"""

from google.protobuf.message import Message

from swarm.rpc import swarm_pb2 as pb

_STAGE = pb.DESCRIPTOR.services_by_name["Stage"]
SERVICE = _STAGE.full_name
# method name -> (request type, response type), in the .proto's order
METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)) for m in _STAGE.methods
}


def method_path(name: str) -> str:
    """The gRPC path of a method of the stage service, e.g. /swarm.Stage/Forward."""
    return f"/{SERVICE}/{name}"


__all__ = ["METHODS", "SERVICE", "method_path", "pb"]
