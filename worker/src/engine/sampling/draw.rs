//! The random number behind each sampled token: a pure function of the
//! sequence's seed and the token's completion position, so that a worker
//! continuing a stream after a failover draws what the first worker would
//! have drawn, whatever was drawn before.
//!
//! The numbers are the 64-bit words of a ChaCha12 keystream keyed by the
//! seed: position N takes the N-th one. ChaCha is counter-based, so seeking
//! to a position costs one block, and its output is fixed by the algorithm
//! (not by a crate's seeding scheme), so workers of different builds agree.
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;

/// The draws of one sequence.
#[derive(Clone, Debug)]
pub struct Draws {
    key: [u8; 32],
}

impl Draws {
    /// The draws of `seed`: its 8 little-endian bytes, zero-padded, are the
    /// ChaCha key.
    pub fn new(seed: u64) -> Self {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        Self { key }
    }

    /// The number for the completion token at `position` (the count of
    /// completion tokens before it).
    pub fn at(&self, position: usize) -> u64 {
        let mut rng = ChaCha12Rng::from_seed(self.key);
        // The stream counts 32-bit words; each position takes two.
        rng.set_word_pos(2 * position as u128);
        rng.next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Position N is the N-th word of the plain keystream, whichever
    /// positions were asked for before (in any order).
    #[test]
    fn position_n_is_the_nth_word_of_the_stream() {
        let d = Draws::new(42);
        let mut stream = ChaCha12Rng::from_seed(d.key);
        let sequential: Vec<u64> = (0..100).map(|_| stream.next_u64()).collect();
        for n in [57, 3, 99, 0, 64, 63, 1] {
            assert_eq!(d.at(n), sequential[n], "position {n}");
        }
    }

    #[test]
    fn seeds_and_positions_give_different_numbers() {
        let (a, b) = (Draws::new(1), Draws::new(2));
        assert_ne!(a.at(0), b.at(0));
        assert_ne!(a.at(0), a.at(1));
        assert_eq!(a.at(5), Draws::new(1).at(5));
    }
}
