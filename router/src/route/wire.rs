//! The worker's messages forwarded as bytes (issue 20).
//!
//! Decoding every worker `Delta` with prost (a `String`, a `Vec` of token
//! ids, the usage) and encoding it again for the client was about a fifth of
//! the router's instructions per token, although the router changes only the
//! message's `seq` and reads only its token ids. The worker-side codec here
//! keeps a `Delta` message as the bytes it arrived in, after a scan that
//! checks it as prost would and finds the two things the router needs; the
//! client-side codec writes those bytes back with the router's `seq` in place
//! of the worker's. `Accepted` and `Finished` come once per stream and are
//! decoded with prost, as is anything the scan does not recognise as the
//! plain shape prost itself writes: prost then decides, so an odd but valid
//! message means what it meant before and a broken one fails as before.
use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{decode_key, decode_varint, encode_varint, encoded_len_varint, WireType};
use prost::Message;
use std::ops::Range;
use tokenmesh_proto::v1::{
    generate_response::Event, Accepted, Delta, Finished, GenerateRequest, GenerateResponse,
    WorkerGenerateRequest,
};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// `GenerateResponse` field numbers.
const SEQ: u32 = 1;
const ACCEPTED: u32 = 2;
const DELTA: u32 = 3;
const FINISHED: u32 = 4;
/// `Delta` field numbers.
const TOKEN_IDS: u32 = 1;
const TEXT: u32 = 2;
const LOGPROBS: u32 = 3;
const USAGE: u32 = 4;
/// The key of `seq` (field 1, varint).
const SEQ_KEY: u8 = 0x08;

/// One message of a worker's `Generate` stream, as the router needs it.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerMessage {
    /// The worker's `Accepted` (the router sends its own).
    Accepted(Accepted),
    /// Tokens, kept encoded.
    Delta(EncodedDelta),
    /// The end of the stream.
    Finished(Finished),
    /// No event the router knows (prost's `event: None`).
    Empty,
}

/// A worker's `GenerateResponse` carrying a `Delta`, in its wire encoding.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedDelta {
    /// The whole message as the worker encoded it.
    bytes: Bytes,
    /// Where the worker's `seq` field is in `bytes` (empty if it had none).
    seq: Range<usize>,
    /// Where the `Delta`'s own fields are in `bytes`.
    body: Range<usize>,
    /// How many token ids it carries.
    tokens: usize,
    /// Its cumulative `usage.completion_tokens`, if it carries a usage.
    completion: Option<u32>,
}

impl WorkerMessage {
    /// Reads one encoded `GenerateResponse`; an error is prost's.
    pub fn parse(bytes: Bytes) -> Result<Self, prost::DecodeError> {
        match scan(&bytes) {
            Some(Shape::Delta {
                seq,
                body,
                tokens,
                completion,
            }) => Ok(Self::Delta(EncodedDelta {
                bytes,
                seq,
                body,
                tokens,
                completion,
            })),
            Some(Shape::Other) | None => Self::decoded(GenerateResponse::decode(bytes)?),
        }
    }

    /// From a message prost decoded.
    fn decoded(msg: GenerateResponse) -> Result<Self, prost::DecodeError> {
        Ok(match msg.event {
            Some(Event::Accepted(a)) => Self::Accepted(a),
            Some(Event::Finished(f)) => Self::Finished(f),
            Some(Event::Delta(d)) => Self::Delta(EncodedDelta::new(&d)),
            None => Self::Empty,
        })
    }
}

impl EncodedDelta {
    /// `delta` encoded as a worker would send it (with no `seq`).
    pub fn new(delta: &Delta) -> Self {
        let bytes = Bytes::from(
            GenerateResponse {
                seq: 0,
                event: Some(Event::Delta(delta.clone())),
            }
            .encode_to_vec(),
        );
        let key = 1;
        let len = encoded_len_varint(delta.encoded_len() as u64);
        Self {
            seq: 0..0,
            body: key + len..bytes.len(),
            bytes,
            tokens: delta.token_ids.len(),
            completion: delta.usage.map(|u| u.completion_tokens),
        }
    }

    /// How many token ids it carries.
    pub fn token_count(&self) -> usize {
        self.tokens
    }

    /// The stream's completion tokens so far, as its usage counts them
    /// (also the tokens of a worker whose engine sends no ids).
    pub fn completion_tokens(&self) -> Option<u32> {
        self.completion
    }

    /// Its token ids, in order.
    pub fn token_ids(&self) -> TokenIds<'_> {
        TokenIds {
            fields: &self.bytes[self.body.clone()],
            packed: &[],
        }
    }

    /// The `Delta`, decoded (for the HTTP API, which renders it as JSON).
    pub fn decode(&self) -> Result<Delta, prost::DecodeError> {
        Delta::decode(&self.bytes[self.body.clone()])
    }

    /// The length of its encoding with `seq` as the message's `seq`.
    pub fn encoded_len(&self, seq: u64) -> usize {
        seq_len(seq) + self.bytes.len() - self.seq.len()
    }

    /// Writes the message with `seq` in place of the worker's: the bytes
    /// prost writes for the same message when the worker's came from prost.
    pub fn encode(&self, seq: u64, dst: &mut impl BufMut) {
        if seq != 0 {
            dst.put_u8(SEQ_KEY);
            encode_varint(seq, dst);
        }
        dst.put_slice(&self.bytes[..self.seq.start]);
        dst.put_slice(&self.bytes[self.seq.end..]);
    }
}

/// Bytes of the `seq` field (none for 0, proto3's default).
fn seq_len(seq: u64) -> usize {
    match seq {
        0 => 0,
        s => 1 + encoded_len_varint(s),
    }
}

/// The token ids of an [`EncodedDelta`], packed or not.
pub struct TokenIds<'a> {
    /// The `Delta` fields not yet looked at.
    fields: &'a [u8],
    /// What is left of the packed `token_ids` field being read.
    packed: &'a [u8],
}

impl Iterator for TokenIds<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        // The bytes were checked by `scan`: nothing here fails.
        loop {
            if self.packed.has_remaining() {
                return decode_varint(&mut self.packed).ok().map(|v| v as u32);
            }
            if !self.fields.has_remaining() {
                return None;
            }
            let (tag, wire) = decode_key(&mut self.fields).ok()?;
            match (tag, wire) {
                (TOKEN_IDS, WireType::Varint) => {
                    return decode_varint(&mut self.fields).ok().map(|v| v as u32)
                }
                (TOKEN_IDS, WireType::LengthDelimited) => {
                    self.packed = take_len(&mut self.fields)?;
                }
                _ => skip(wire, &mut self.fields)?,
            }
        }
    }
}

/// What [`scan`] found.
#[derive(Debug, PartialEq)]
enum Shape {
    /// One `seq` at most and one `Delta`, both as prost reads them.
    Delta {
        seq: Range<usize>,
        body: Range<usize>,
        tokens: usize,
        completion: Option<u32>,
    },
    /// Some other event, or none: prost decodes it.
    Other,
}

/// Finds the `seq` and the `Delta` of an encoded `GenerateResponse`. `None`
/// for anything that is not the plain shape (two `seq` or two events, which
/// prost merges, a wire type prost would refuse, groups, bad UTF-8, a
/// truncated field): prost then decodes the message and has the last word.
fn scan(msg: &[u8]) -> Option<Shape> {
    let mut buf = msg;
    let at = |buf: &[u8]| msg.len() - buf.len();
    let mut seq = None;
    let mut event: Option<(u32, Range<usize>)> = None;
    while buf.has_remaining() {
        let start = at(buf);
        let (tag, wire) = decode_key(&mut buf).ok()?;
        match (tag, wire) {
            (SEQ, WireType::Varint) if seq.is_none() => {
                decode_varint(&mut buf).ok()?;
                seq = Some(start..at(buf));
            }
            (ACCEPTED | DELTA | FINISHED, WireType::LengthDelimited) if event.is_none() => {
                let body = take_len(&mut buf)?;
                let end = at(buf);
                event = Some((tag, end - body.len()..end));
            }
            (SEQ | ACCEPTED | DELTA | FINISHED, _) => return None,
            _ => skip(wire, &mut buf)?,
        }
    }
    match event {
        Some((DELTA, body)) => {
            let (tokens, completion) = scan_delta(&msg[body.clone()])?;
            Some(Shape::Delta {
                tokens,
                completion,
                seq: seq.unwrap_or(0..0),
                body,
            })
        }
        _ => Some(Shape::Other),
    }
}

/// Checks a `Delta`'s fields as prost reads them; the number of token ids
/// and the usage's completion tokens (prost's: the last value read, zero
/// in a usage without one).
fn scan_delta(mut buf: &[u8]) -> Option<(usize, Option<u32>)> {
    let mut tokens = 0;
    // A usage was read; the last `completion_tokens` set in one (repeated
    // usage fields merge, as prost merges them).
    let (mut usage, mut completion) = (false, None);
    while buf.has_remaining() {
        let (tag, wire) = decode_key(&mut buf).ok()?;
        match (tag, wire) {
            (TOKEN_IDS, WireType::Varint) => {
                decode_varint(&mut buf).ok()?;
                tokens += 1;
            }
            (TOKEN_IDS, WireType::LengthDelimited) => {
                let mut packed = take_len(&mut buf)?;
                while packed.has_remaining() {
                    decode_varint(&mut packed).ok()?;
                    tokens += 1;
                }
            }
            (TEXT, WireType::LengthDelimited) => {
                std::str::from_utf8(take_len(&mut buf)?).ok()?;
            }
            (LOGPROBS, WireType::LengthDelimited) => {
                if take_len(&mut buf)?.len() % 4 != 0 {
                    return None;
                }
            }
            (LOGPROBS, WireType::ThirtyTwoBit) => skip(wire, &mut buf)?,
            (USAGE, WireType::LengthDelimited) => {
                usage = true;
                completion = scan_usage(take_len(&mut buf)?)?.or(completion);
            }
            (TOKEN_IDS | TEXT | LOGPROBS | USAGE, _) => return None,
            _ => skip(wire, &mut buf)?,
        }
    }
    Some((tokens, usage.then(|| completion.unwrap_or(0))))
}

/// Checks a `Usage` (two uint32 fields); its `completion_tokens`, if set.
fn scan_usage(mut buf: &[u8]) -> Option<Option<u32>> {
    let mut completion = None;
    while buf.has_remaining() {
        let (tag, wire) = decode_key(&mut buf).ok()?;
        match (tag, wire) {
            (1, WireType::Varint) => {
                decode_varint(&mut buf).ok()?;
            }
            // prost keeps the low 32 bits of a uint32 written wider.
            (2, WireType::Varint) => completion = Some(decode_varint(&mut buf).ok()? as u32),
            (1 | 2, _) => return None,
            _ => skip(wire, &mut buf)?,
        }
    }
    Some(completion)
}

/// The payload of a length-delimited field whose key was just read.
fn take_len<'a>(buf: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = usize::try_from(decode_varint(buf).ok()?).ok()?;
    if len > buf.len() {
        return None;
    }
    let (payload, rest) = buf.split_at(len);
    *buf = rest;
    Some(payload)
}

/// Skips an unknown field's value (kept in the bytes all the same); groups,
/// which prost tracks with a depth, are left to prost.
fn skip(wire: WireType, buf: &mut &[u8]) -> Option<()> {
    let n = match wire {
        WireType::Varint => return decode_varint(buf).ok().map(|_| ()),
        WireType::LengthDelimited => return take_len(buf).map(|_| ()),
        WireType::SixtyFourBit => 8,
        WireType::ThirtyTwoBit => 4,
        WireType::StartGroup | WireType::EndGroup => return None,
    };
    if buf.len() < n {
        return None;
    }
    buf.advance(n);
    Some(())
}

/// A message for the client: numbered by the router, a `Delta` still in the
/// worker's encoding.
#[derive(Debug, Clone, PartialEq)]
pub enum Outgoing {
    /// A message the router built (`Accepted`, `Finished`).
    Message(GenerateResponse),
    /// A worker's `Delta`, renumbered as `seq`.
    Delta {
        /// The client's `seq` of the message.
        seq: u64,
        /// The worker's message.
        delta: EncodedDelta,
    },
}

impl Outgoing {
    /// The message, decoded.
    pub fn into_message(self) -> Result<GenerateResponse, Status> {
        match self {
            Self::Message(m) => Ok(m),
            Self::Delta { seq, delta } => Ok(GenerateResponse {
                seq,
                event: Some(Event::Delta(delta.decode().map_err(decode_error)?)),
            }),
        }
    }
}

/// As tonic's prost codec reports a message it cannot decode.
fn decode_error(e: prost::DecodeError) -> Status {
    Status::internal(e.to_string())
}

/// The router's side of `Worker.Generate`: requests encoded by prost, the
/// responses read as [`WorkerMessage`]s.
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkerCodec;

impl Codec for WorkerCodec {
    type Encode = WorkerGenerateRequest;
    type Decode = WorkerMessage;
    type Encoder = ProstEncoder<WorkerGenerateRequest>;
    type Decoder = WorkerDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<WorkerGenerateRequest, WorkerGenerateRequest>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        WorkerDecoder
    }
}

/// Reads a worker's `GenerateResponse` as a [`WorkerMessage`].
#[derive(Debug, Clone, Copy)]
pub struct WorkerDecoder;

impl Decoder for WorkerDecoder {
    type Item = WorkerMessage;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<WorkerMessage>, Status> {
        // Takes the message's bytes out of tonic's buffer without a copy.
        let bytes = src.copy_to_bytes(src.remaining());
        WorkerMessage::parse(bytes).map(Some).map_err(decode_error)
    }
}

/// The router's side of `Inference.Generate`: requests decoded by prost,
/// [`Outgoing`] messages written as they are.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientCodec;

impl Codec for ClientCodec {
    type Encode = Outgoing;
    type Decode = GenerateRequest;
    type Encoder = OutgoingEncoder;
    type Decoder = ProstDecoder<GenerateRequest>;

    fn encoder(&mut self) -> Self::Encoder {
        OutgoingEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<GenerateResponse, GenerateRequest>::default().decoder()
    }
}

/// Writes an [`Outgoing`] message.
#[derive(Debug, Clone, Copy)]
pub struct OutgoingEncoder;

impl Encoder for OutgoingEncoder {
    type Item = Outgoing;
    type Error = Status;

    fn encode(&mut self, item: Outgoing, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        match item {
            Outgoing::Message(m) => m
                .encode(dst)
                .map_err(|e| Status::internal(format!("encoding: {e}"))),
            Outgoing::Delta { seq, delta } => {
                dst.reserve(delta.encoded_len(seq));
                delta.encode(seq, dst);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests;
