//! Reading a GGUF file's header (metadata and tensor directory), with the
//! checks candle's reader lacks done first: a weight type it does not know
//! is named rather than numbered, and a `general.alignment` of 0 (candle
//! divides by it) or not a power of two (llama.cpp's rule) is refused
//! instead of panicking. The pre-scan reads only the header, with every
//! length checked against the file's size, so it allocates nothing a
//! corrupt header claims.
use candle_core::quantized::gguf_file::Content;
use std::io::{BufRead, Read, Seek, SeekFrom};

/// The weight types a GGUF file may store (those candle reads; the CPU
/// kernels run some as stored and requantize the others), for messages.
pub const SUPPORTED_WEIGHT_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K";

/// Why a GGUF header could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error(
        "tensor {tensor} is stored as {kind}, a weight type tokenmesh does not read \
         (supported: {SUPPORTED_WEIGHT_TYPES})"
    )]
    WeightType { tensor: String, kind: String },
    #[error("general.alignment is {0}; GGUF requires a power of two (32 when absent)")]
    Alignment(u64),
    #[error("not a readable GGUF file: {0}")]
    Gguf(#[from] candle_core::Error),
    #[error("reading the GGUF header: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads the header of the GGUF file `reader` holds, from its start.
pub fn read<R: Read + Seek>(reader: &mut R) -> Result<Content, HeaderError> {
    let scan = scan(reader);
    reader.seek(SeekFrom::Start(0))?;
    if let Some(scan) = &scan {
        if let Some(a) = scan.alignment {
            if !a.is_power_of_two() {
                return Err(HeaderError::Alignment(a));
            }
        }
    }
    match Content::read(reader) {
        Ok(content) => Ok(content),
        // A weight type the reader does not know fails the header; name
        // it, rather than the reader's number.
        Err(e) => match scan.and_then(|s| s.unsupported) {
            Some((tensor, kind)) => Err(HeaderError::WeightType { tensor, kind }),
            None => Err(e.into()),
        },
    }
}

/// What the pre-scan found.
#[derive(Debug, Default, PartialEq)]
struct Scan {
    /// `general.alignment` when it is stored as an integer.
    alignment: Option<u64>,
    /// The first tensor whose weight type is not supported: its name and
    /// ggml's name of its type.
    unsupported: Option<(String, String)>,
}

/// Walks the header; None when it is not readable as GGUF v2/v3 (then
/// candle's reader says why).
fn scan<R: Read + Seek>(reader: &mut R) -> Option<Scan> {
    let file_len = reader.seek(SeekFrom::End(0)).ok()?;
    reader.seek(SeekFrom::Start(0)).ok()?;
    let mut r = std::io::BufReader::new(reader);
    if u32_(&mut r)? != 0x4655_4747 || u32_(&mut r)? < 2 {
        return None;
    }
    let (n_tensors, n_kv) = (u64_(&mut r)?, u64_(&mut r)?);
    // Every entry takes a dozen bytes or more.
    if n_tensors > file_len || n_kv > file_len {
        return None;
    }
    let mut found = Scan::default();
    for _ in 0..n_kv {
        let key_len = u64_(&mut r)?;
        let key = if key_len == ALIGNMENT_KEY.len() as u64 {
            let mut key = [0u8; ALIGNMENT_KEY.len()];
            r.read_exact(&mut key).ok()?;
            key == *ALIGNMENT_KEY
        } else {
            skip(&mut r, key_len, file_len)?;
            false
        };
        let kind = u32_(&mut r)?;
        match (key, integer(&mut r, kind)?) {
            (true, Some(v)) => found.alignment = Some(v),
            (_, Some(_)) => {}
            (_, None) => value(&mut r, kind, file_len, 0)?,
        }
    }
    for _ in 0..n_tensors {
        let name_len = u64_(&mut r)?;
        if name_len > 1 << 16 {
            return None;
        }
        let mut name = vec![0u8; name_len as usize];
        r.read_exact(&mut name).ok()?;
        let n_dims = u32_(&mut r)?;
        skip(&mut r, 8 * u64::from(n_dims.min(64)), file_len)?;
        let kind = u32_(&mut r)?;
        let _offset = u64_(&mut r)?;
        if !matches!(kind, 0..=3 | 6..=15 | 30) {
            found.unsupported = Some((
                String::from_utf8_lossy(&name).into_owned(),
                ggml_type_name(kind),
            ));
            break;
        }
    }
    Some(found)
}

const ALIGNMENT_KEY: &[u8; 17] = b"general.alignment";

fn u32_(r: &mut impl Read) -> Option<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b).ok()?;
    Some(u32::from_le_bytes(b))
}

fn u64_(r: &mut impl Read) -> Option<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

/// Reads a value of integer `kind` as u64 (negative ones as u64::MAX, never
/// a valid alignment); Some(None) when `kind` is not an integer type, and
/// nothing was read.
fn integer(r: &mut impl Read, kind: u32) -> Option<Option<u64>> {
    let mut b = [0u8; 8];
    let v = match kind {
        0 => {
            r.read_exact(&mut b[..1]).ok()?;
            u64::from(b[0])
        }
        1 => {
            r.read_exact(&mut b[..1]).ok()?;
            u64::try_from(b[0] as i8).unwrap_or(u64::MAX)
        }
        2 => {
            r.read_exact(&mut b[..2]).ok()?;
            u64::from(u16::from_le_bytes([b[0], b[1]]))
        }
        3 => {
            r.read_exact(&mut b[..2]).ok()?;
            u64::try_from(i16::from_le_bytes([b[0], b[1]])).unwrap_or(u64::MAX)
        }
        4 => u64::from(u32_(r)?),
        5 => u64::try_from(u32_(r)? as i32).unwrap_or(u64::MAX),
        10 => u64_(r)?,
        11 => u64::try_from(u64_(r)? as i64).unwrap_or(u64::MAX),
        _ => return Some(None),
    };
    Some(Some(v))
}

fn skip<B: BufRead + Seek>(r: &mut B, n: u64, file_len: u64) -> Option<()> {
    (n <= file_len).then_some(())?;
    r.seek_relative(i64::try_from(n).ok()?).ok()
}

/// Skips one metadata value of `kind`.
fn value<B: BufRead + Seek>(r: &mut B, kind: u32, file_len: u64, depth: u32) -> Option<()> {
    match kind {
        0 | 1 | 7 => skip(r, 1, file_len),
        2 | 3 => skip(r, 2, file_len),
        4..=6 => skip(r, 4, file_len),
        10..=12 => skip(r, 8, file_len),
        8 => {
            let len = u64_(r)?;
            skip(r, len, file_len)
        }
        9 if depth < 4 => {
            let elem = u32_(r)?;
            let count = u64_(r)?;
            let fixed = match elem {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            };
            match fixed {
                Some(size) => skip(r, count.checked_mul(size)?, file_len),
                None => {
                    (count <= file_len).then_some(())?;
                    (0..count).try_for_each(|_| value(r, elem, file_len, depth + 1))
                }
            }
        }
        _ => None,
    }
}

/// ggml's name of tensor type `id` (ggml.h's `ggml_type`).
fn ggml_type_name(id: u32) -> String {
    const NAMES: &[(u32, &str)] = &[
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    NAMES
        .iter()
        .find(|(i, _)| *i == id)
        .map_or_else(|| format!("type {id}"), |(_, n)| (*n).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::io::Cursor;

    fn file(metadata: &[(&str, Value)]) -> Vec<u8> {
        let t = Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let mut out = Cursor::new(Vec::new());
        gguf_file::write(&mut out, &md, &[("w", &q)]).unwrap();
        out.into_inner()
    }

    #[test]
    fn an_alignment_of_zero_or_not_a_power_of_two_is_refused() {
        for (v, shown) in [
            (Value::U32(0), 0),
            (Value::U64(48), 48),
            (Value::I32(-32), u64::MAX),
        ] {
            let bytes = file(&[
                ("a.key", Value::String("x".into())),
                ("general.alignment", v),
            ]);
            let e = read(&mut Cursor::new(bytes)).unwrap_err();
            assert!(matches!(e, HeaderError::Alignment(a) if a == shown), "{e}");
            assert!(e.to_string().contains("power of two"), "{e}");
        }
    }

    #[test]
    fn a_valid_header_reads_and_its_alignment_is_found() {
        let bytes = file(&[
            ("general.name", Value::String("t".into())),
            ("general.alignment", Value::U32(64)),
            ("list", Value::Array(vec![Value::U8(1), Value::U8(2)])),
        ]);
        let content = read(&mut Cursor::new(&bytes)).unwrap();
        assert_eq!(content.tensor_infos.len(), 1);
        let scan = scan(&mut Cursor::new(&bytes)).unwrap();
        assert_eq!(scan.alignment, Some(64));
        assert_eq!(scan.unsupported, None);
        // Without the key there is nothing to check.
        let bytes = file(&[("general.name", Value::String("t".into()))]);
        assert!(read(&mut Cursor::new(bytes)).is_ok());
    }
}
