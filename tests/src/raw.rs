//! Raw gRPC calls: arbitrary bytes as the request message, in a well-formed
//! gRPC frame, to see what a server answers to input its own stubs could
//! never send (garbage, invalid UTF-8, a truncated message, an oversize one).
use bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::Status;

/// Sends and receives messages as the bytes they are.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }
}

/// Calls `path` (`/package.Service/Method`, unary or server-streaming) on
/// `channel` with `message` as the request's bytes and reads the reply to its
/// end: the number of messages, or the status it ended with.
pub async fn raw_call(
    channel: Channel,
    path: &'static str,
    message: Vec<u8>,
) -> Result<usize, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    let mut stream = grpc
        .server_streaming(tonic::Request::new(message), path, RawCodec)
        .await?
        .into_inner();
    let mut n = 0;
    while stream.message().await?.is_some() {
        n += 1;
    }
    Ok(n)
}
