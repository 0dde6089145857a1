//! What each request asks for: prompts and max_tokens, drawn from a seed so
//! that a run can be repeated exactly.
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt;
use std::str::FromStr;

/// A fixed number (`64`) or a uniform range (`16..128`, both ends included).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Spread {
    pub min: u32,
    pub max: u32,
}

impl FromStr for Spread {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("{s:?}: expected a number like 64 or a range like 16..128"))
        };
        let spread = match s.split_once("..") {
            Some((a, b)) => Spread {
                min: num(a)?,
                max: num(b.trim_start_matches('='))?,
            },
            None => {
                let n = num(s)?;
                Spread { min: n, max: n }
            }
        };
        if spread.min == 0 || spread.min > spread.max {
            return Err(format!("{s:?}: need 1 <= min <= max"));
        }
        Ok(spread)
    }
}

impl fmt::Display for Spread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}..{}", self.min, self.max)
        }
    }
}

impl Spread {
    fn sample(&self, rng: &mut StdRng) -> u32 {
        rng.random_range(self.min..=self.max)
    }
}

/// Plain English words; with the real model most are one or two tokens, with
/// the synthetic engine exactly one.
const WORDS: &[&str] = &[
    "the", "river", "carries", "light", "over", "stones", "while", "small", "birds", "sing",
    "about", "morning", "bread", "and", "quiet", "streets", "a", "train", "leaves", "town",
    "under", "grey", "clouds", "people", "read", "letters", "from", "old", "friends", "near",
    "warm", "windows",
];

/// How long prompts and replies are: the flags `meshctl bench` and
/// `meshctl bench sweep` share.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct ShapeArgs {
    /// Words per prompt: a number, or a range MIN..MAX sampled uniformly.
    #[arg(long, default_value = "32")]
    pub prompt_words: Spread,
    /// max_tokens per request: a number, or a range MIN..MAX sampled uniformly.
    #[arg(long, default_value = "64")]
    pub max_tokens: Spread,
}

/// One request's shape.
#[derive(Clone, Debug)]
pub struct Shape {
    pub prompt: String,
    pub max_tokens: u32,
}

/// Draws request shapes from a seed.
pub struct Workload {
    rng: StdRng,
    prompt_words: Spread,
    max_tokens: Spread,
}

impl Workload {
    pub fn new(seed: u64, shape: ShapeArgs) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            prompt_words: shape.prompt_words,
            max_tokens: shape.max_tokens,
        }
    }

    /// The next request's prompt and max_tokens.
    pub fn next_shape(&mut self) -> Shape {
        let n = self.prompt_words.sample(&mut self.rng) as usize;
        let words: Vec<&str> = (0..n)
            .map(|_| WORDS[self.rng.random_range(0..WORDS.len())])
            .collect();
        Shape {
            prompt: words.join(" "),
            max_tokens: self.max_tokens.sample(&mut self.rng),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_parse() {
        assert_eq!("64".parse::<Spread>().unwrap(), Spread { min: 64, max: 64 });
        assert_eq!(
            "16..128".parse::<Spread>().unwrap(),
            Spread { min: 16, max: 128 }
        );
        assert!("0".parse::<Spread>().is_err());
        assert!("9..3".parse::<Spread>().is_err());
        assert!("x".parse::<Spread>().is_err());
    }

    #[test]
    fn the_same_seed_gives_the_same_requests() {
        let shape = ShapeArgs {
            prompt_words: "4..40".parse().unwrap(),
            max_tokens: "8..16".parse().unwrap(),
        };
        let (mut a, mut b) = (Workload::new(7, shape), Workload::new(7, shape));
        for _ in 0..20 {
            let (x, y) = (a.next_shape(), b.next_shape());
            assert_eq!(x.prompt, y.prompt);
            assert_eq!(x.max_tokens, y.max_tokens);
            let words = x.prompt.split_whitespace().count();
            assert!((4..=40).contains(&words));
            assert!((8..=16).contains(&x.max_tokens));
        }
    }
}
