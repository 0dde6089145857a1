//! The compute device: `cpu` always; `cuda:N` when built with the `cuda`
//! feature (candle's CUDA backend, cudarc underneath). Accelerator telemetry
//! (device name, memory) comes from the CUDA driver through candle's cudarc.
use candle_core::Device;

/// Why a device could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum AcceleratorError {
    #[error("--device {0}: use cpu or cuda:N")]
    Unknown(String),
    #[error("--device {0}: this binary was built without CUDA; rebuild with `cargo build --release --features cuda` (scripts/gpu-check.sh)")]
    NotBuilt(String),
    #[error("--device {spec}: {message}")]
    Open { spec: String, message: String },
}

/// An opened device and what registration and Status report about it.
#[derive(Clone, Debug)]
pub struct Accelerator {
    pub device: Device,
    /// `cpu`, `cuda` (and `npu`, a recognised kind for future backends).
    pub kind: &'static str,
    /// Human-readable device name.
    pub name: String,
}

impl Accelerator {
    /// Opens `spec`: `cpu`, `cuda` (device 0) or `cuda:N`.
    pub fn open(spec: &str) -> Result<Self, AcceleratorError> {
        match spec {
            "cpu" => Ok(Self {
                device: Device::Cpu,
                kind: "cpu",
                name: "cpu".into(),
            }),
            s if s == "cuda" || s.starts_with("cuda:") => {
                let ordinal: usize = match s.strip_prefix("cuda:") {
                    None => 0,
                    Some(n) => n.parse().map_err(|_| AcceleratorError::Unknown(s.into()))?,
                };
                open_cuda(s, ordinal)
            }
            other => Err(AcceleratorError::Unknown(other.into())),
        }
    }

    /// (used, total) device memory in bytes, for accelerators that have their own.
    pub fn memory(&self) -> Option<(u64, u64)> {
        memory(&self.device)
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(spec: &str, ordinal: usize) -> Result<Accelerator, AcceleratorError> {
    let err = |e: candle_core::Error| AcceleratorError::Open {
        spec: spec.into(),
        message: e.to_string(),
    };
    let device = Device::new_cuda(ordinal).map_err(err)?;
    let name = device
        .as_cuda_device()
        .map_err(err)?
        .cuda_stream()
        .context()
        .name()
        .unwrap_or_else(|_| format!("cuda:{ordinal}"));
    Ok(Accelerator {
        device,
        kind: "cuda",
        name,
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: &str, _ordinal: usize) -> Result<Accelerator, AcceleratorError> {
    Err(AcceleratorError::NotBuilt(spec.into()))
}

#[cfg(feature = "cuda")]
fn memory(device: &Device) -> Option<(u64, u64)> {
    let cuda = device.as_cuda_device().ok()?;
    let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
    Some(((total - free) as u64, total as u64))
}

#[cfg(not(feature = "cuda"))]
fn memory(_device: &Device) -> Option<(u64, u64)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_opens_and_reports_no_device_memory() {
        let a = Accelerator::open("cpu").unwrap();
        assert_eq!((a.kind, a.memory()), ("cpu", None));
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        assert!(matches!(
            Accelerator::open("tpu"),
            Err(AcceleratorError::Unknown(_))
        ));
        assert!(matches!(
            Accelerator::open("cuda:x"),
            Err(AcceleratorError::Unknown(_))
        ));
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            Accelerator::open("cuda:0"),
            Err(AcceleratorError::NotBuilt(_))
        ));
    }
}
