//! gRPC server reflection, as every tokenmesh server mounts it.
use tonic_reflection::server::{v1, v1alpha, Builder};

/// gRPC server reflection over the tokenmesh and health services, in both
/// protocol versions: grpcurl 1.8 asks for v1alpha only, newer clients for v1.
pub fn reflection() -> (
    v1::ServerReflectionServer<impl v1::ServerReflection>,
    v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>,
) {
    let builder = || {
        Builder::configure()
            .register_encoded_file_descriptor_set(tokenmesh_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    (
        builder()
            .build_v1()
            .expect("the embedded descriptor sets are valid"),
        builder()
            .build_v1alpha()
            .expect("the embedded descriptor sets are valid"),
    )
}
