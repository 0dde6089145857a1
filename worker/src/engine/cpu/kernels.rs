//! Which CPU kernels run: the SIMD ones (AVX2, and the AVX-512 VNNI variants
//! of the integer products) or the portable loops. Chosen once when the model
//! loads, from the worker's `--cpu-simd` and `--cpu-vnni`, and narrowed to
//! what the CPU has, so a kernel never checks the environment or a global.

/// The kernel choice the compute threads carry (see `ComputePool::kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuKernels {
    simd: bool,
    vnni: bool,
}

impl CpuKernels {
    /// The kernels asked for, where this CPU runs them: `simd` allows the
    /// SIMD kernels, `vnni` their VNNI variants (which give the same integers
    /// in fewer instructions; they need the SIMD kernels on).
    pub fn new(simd: bool, vnni: bool) -> Self {
        #[cfg(target_arch = "x86_64")]
        let (simd, vnni) = {
            let simd = simd && super::x86::supported();
            (simd, simd && vnni && super::x86::vnni_supported())
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (simd, vnni) = {
            let _ = (simd, vnni);
            (false, false)
        };
        Self { simd, vnni }
    }

    /// The portable loops only: what a CPU without AVX2 runs.
    pub fn portable() -> Self {
        Self {
            simd: false,
            vnni: false,
        }
    }

    /// Whether the SIMD kernels run.
    pub fn simd(&self) -> bool {
        self.simd
    }

    /// Whether the VNNI variants of the interleaved kernels run.
    pub fn vnni(&self) -> bool {
        self.vnni
    }
}

impl Default for CpuKernels {
    /// The fastest kernels this CPU has.
    fn default() -> Self {
        Self::new(true, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_only_narrow_what_the_cpu_has() {
        let best = CpuKernels::default();
        assert_eq!(CpuKernels::new(false, true), CpuKernels::portable());
        assert!(!CpuKernels::new(true, false).vnni());
        assert_eq!(CpuKernels::new(true, false).simd(), best.simd());
        assert!(!best.vnni() || best.simd());
    }
}
