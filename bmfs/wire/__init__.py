"""Code generated from schemas/ by tools/gen_schemas.py. Do not edit.

Compiled with libprotoc 3.21.12 and flatc version 2.0.8. bmfs.typed.registry imports
these lazily to resolve type names such as 'proto:bmfs.examples.Sample'.
"""

# protobuf modules, relative to this package
PROTO_MODULES = (
    'etcd_rpc_pb2',
    'examples_pb2',
    'examples_v2_pb2',
    'node_pb2',
)

# flatbuffers root-able tables: full name -> module defining a class of that name
FBS_TABLES = {
    'bmfs.examples.Frame': 'bmfs.wire.fbs.bmfs.examples.Frame',
}
